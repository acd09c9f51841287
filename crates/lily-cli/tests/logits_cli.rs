//! `lily logits --rows-from R` (a long prompt's last rows without the whole
//! prompt's logits) writes exactly rows R.. of what the whole run writes, and
//! refuses an R past the tokens. On the CPU with the tiny synthetic model.

mod support;

use std::ffi::OsString;
use std::path::Path;

use support::run_logits;

/// Run `lily logits` on the tiny model; the logits [rows, vocab] as written.
fn logits(dir: &Path, name: &str, extra: &[&str]) -> Result<(Vec<usize>, Vec<f32>), String> {
    let path = dir.join(name);
    let mut args: Vec<OsString> = [
        "logits",
        "--device",
        "cpu",
        "--synthetic",
        "tiny",
        "--tokens",
        "5,17,300,2,99,1000,7,8",
        "--decode-from",
        "6",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.extend(extra.iter().map(OsString::from));
    args.extend(["--out".into(), path.clone().into()]);
    run_logits(&args, &path)
}

#[test]
fn rows_from_writes_the_last_rows_of_the_whole_run() {
    let dir = std::env::temp_dir().join(format!("lily-rows-from-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (shape, all) = logits(&dir, "all.safetensors", &[]).unwrap();
    assert_eq!(shape[0], 8);
    let vocab = shape[1];
    // rows in the prefill and the decoded ones, or the decoded ones only
    for r in [3usize, 6, 7] {
        let (s, part) = logits(&dir, "part.safetensors", &["--rows-from", &r.to_string()]).unwrap();
        assert_eq!(s, vec![8 - r, vocab], "--rows-from {r}");
        assert!(
            part == all[r * vocab..],
            "--rows-from {r}: rows differ from the whole run's"
        );
    }
    let err = logits(&dir, "bad.safetensors", &["--rows-from", "8"]).unwrap_err();
    assert!(err.contains("--rows-from 8"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

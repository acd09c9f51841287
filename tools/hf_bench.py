#!/usr/bin/env python3
"""The PyTorch peer on the same weights as `lily bench --synthetic NAME`:
HF transformers 5.17 (bf16, batch 1, on the GPU) with the synthetic model's
exact weights (built by tools/hf_compare.py from `lily synthetic-export`).

Prefill: one forward over P prompt tokens with logits_to_keep=1, median of
--runs after a warm-up. Decode: `generate` greedy, G new tokens after a C-token
prompt, minus the prefill time, median of --runs after a warm-up.
Prints one JSON object (and writes it with --out), with `fast_paths`: which
kernels the loaded model's GDN layers really call (read from the instantiated
layer, see fast_paths()), the attention and experts implementations, the
versions and the GPU; a one-line summary of them goes to stderr.

transformers picks its GDN kernels when its modeling module is imported:
flash-linear-attention (fla) for the chunked and the recurrent gated delta
rule, causal-conv1d for the short convolution, each else a slow PyTorch
reference. Neither package is on the GPU image: carry the wheels that
tools/peer_wheels.sh puts in .whl/ and install them first (it prints the line).
"""
import argparse
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from hf_compare import build


def _dist_version(*names):
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def _package(name, *dists):
    """Version, location and import error of an optional package, as this process sees it."""
    mod, err = sys.modules.get(name), None
    if mod is None:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (any import failure means "not usable")
            err = f"{type(e).__name__}: {e}"
    ver = (getattr(mod, "__version__", None) or _dist_version(*dists)) if mod is not None else None
    return {"version": ver, "file": getattr(mod, "__file__", None), "import_error": err}


def _bound_impl(fn):
    """The callable that a transformers kernel wrapper really calls.

    transformers 5.x wraps each GDN function with
    use_kernel_func_from_hub_with_fallback, which resolves fla /
    causal_conv1d once, at import, into the closure variable `implementation`
    (the torch reference itself when the package is missing); the wrapper's
    __wrapped__ is always the reference, so read the closure first. Older
    versions put the package's function (or None) on the layer directly."""
    seen = set()
    f = fn
    while f is not None and id(f) not in seen:
        seen.add(id(f))
        try:
            nonlocals = inspect.getclosurevars(f).nonlocals
        except TypeError:
            nonlocals = {}
        if "implementation" in nonlocals:
            return nonlocals["implementation"]
        f = getattr(f, "__wrapped__", None)
    return fn


def _name(obj):
    if obj is None:
        return None
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or getattr(obj, '__name__', type(obj).__name__)}"


def _kind(qualname):
    """fla / causal-conv1d / torch (transformers' own reference code) / none / another module's root."""
    if qualname is None:
        return "none"
    root = qualname.split(".")[0]
    return {"fla": "fla", "causal_conv1d": "causal-conv1d", "transformers": "torch", "torch": "torch"}.get(root, root)


# each GDN operation: the layer attribute names older transformers (and the
# `kernels` hub's use_kernelized_func) use, then the modeling module's globals
GDN_OPS = {
    "chunk": ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
    "recurrent": ("recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "conv1d": ("causal_conv1d_fn",),
    "conv1d_update": ("causal_conv1d_update",),
}


def fast_paths(model):
    """Which fast paths the instantiated model uses (not just which packages import)."""
    fp = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "triton": _dist_version("triton"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "fla": _package("fla", "fla-core", "flash-linear-attention"),
        "causal_conv1d": _package("causal_conv1d", "causal-conv1d"),
        "gdn": None,
    }
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is not None:
        modeling = sys.modules.get(type(layer).__module__)
        gdn = {"layer": _name(type(layer))}
        for op, names in GDN_OPS.items():
            impl, found = None, None
            for n in names:
                if hasattr(layer, n):
                    found = f"layer.{n}"
                    impl = _bound_impl(getattr(layer, n))
                    break
                if modeling is not None and hasattr(modeling, n):
                    found = f"{modeling.__name__}.{n}"
                    impl = _bound_impl(getattr(modeling, n))
                    break
            q = _name(impl)
            # (a layer attribute set to None: older transformers' sign of the torch path)
            gdn[op] = {"kind": _kind(q) if found else "not found", "impl": q, "via": found}
        norm = getattr(layer, "norm", None)
        if norm is not None:
            cls, fwd = _name(type(norm)), _name(getattr(type(norm), "forward", None))
            k = _kind(cls)
            if k == "torch" and _kind(fwd) != "torch":  # forward replaced (kernels hub)
                k = _kind(fwd)
            gdn["gated_norm"] = {"kind": k, "impl": cls, "forward": fwd}
        fp["gdn"] = gdn
    g = fp["gdn"] or {}
    kinds = " ".join(f"{op}={g[op]['kind']}" for op in (*GDN_OPS, "gated_norm") if op in g) or "no GDN layer"
    fp["summary"] = (
        f"GDN {kinds}; attn={fp['attn_implementation']} experts={fp['experts_implementation']}; "
        f"fla {fp['fla']['version'] or 'none'}, causal-conv1d {fp['causal_conv1d']['version'] or 'none'}; "
        f"torch {fp['torch']}, transformers {fp['transformers']}, triton {fp['triton']}; {fp['gpu']}"
    )
    return fp


class _Fallbacks(logging.Handler):
    """transformers' warnings that a kernel fell back to its PyTorch reference
    (logged once, at the first call): the runtime confirmation of fast_paths()."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        msg = record.getMessage()
        if ("fall" in msg.lower() and "back" in msg.lower()) or "fast path" in msg.lower():
            if msg not in self.seen:
                self.seen.append(msg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="full")
    ap.add_argument("--lily", default=".carry/lily")
    ap.add_argument("--prompt-len", default="512,4096,16384")
    ap.add_argument("--context", default="512,4096")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--require-fla", action="store_true", help="exit 3 (before timing) unless the GDN chunk and recurrent kernels are fla's")
    a = ap.parse_args()
    exp = f"/tmp/exp-{a.synthetic}"
    if not os.path.exists(f"{exp}/procedural.json"):
        subprocess.run([a.lily, "synthetic-export", "--synthetic", a.synthetic, "--out", exp], check=True)
    fallbacks = _Fallbacks()
    logging.getLogger("transformers").addHandler(fallbacks)
    model = build(exp, "cuda", attn="sdpa")
    fp = fast_paths(model)
    print(f"hf_bench fast paths: {fp['summary']}", file=sys.stderr, flush=True)
    if a.require_fla and any(((fp["gdn"] or {}).get(op) or {}).get("kind") != "fla" for op in ("chunk", "recurrent")):
        print("hf_bench: --require-fla: the GDN kernels are not fla's (install .whl/, see tools/peer_wheels.sh)", file=sys.stderr)
        sys.exit(3)
    random.seed(3)
    vocab = 248077

    def ids(n):
        return torch.tensor([[random.randrange(vocab) for _ in range(n)]], device="cuda")

    def timed(f):
        torch.cuda.synchronize()
        t = time.time()
        f()
        torch.cuda.synchronize()
        return time.time() - t

    res = {"engine": "transformers " + __import__("transformers").__version__, "torch": torch.__version__, "gpu": fp["gpu"], "fast_paths": fp, "prefill": [], "decode": []}
    with torch.no_grad():
        for p in [int(x) for x in a.prompt_len.split(",") if x]:
            x = ids(p)
            timed(lambda: model(input_ids=x, logits_to_keep=1, use_cache=False))
            ts = [timed(lambda: model(input_ids=x, logits_to_keep=1, use_cache=False)) for _ in range(a.runs)]
            s = statistics.median(ts)
            res["prefill"].append({"prompt_len": p, "prefill_tok_s": p / s, "ttft_ms": s * 1e3})
            print(res["prefill"][-1], flush=True)
        for c in [int(x) for x in a.context.split(",") if x]:
            x = ids(c)
            gen = lambda n: model.generate(input_ids=x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            timed(lambda: gen(2))
            pre = statistics.median([timed(lambda: gen(1)) for _ in range(a.runs)])
            ts = [timed(lambda: gen(a.gen + 1)) - pre for _ in range(a.runs)]
            s = statistics.median(ts)
            res["decode"].append({"context": c, "gen": a.gen, "decode_tok_s": a.gen / s, "ms_per_token": s * 1e3 / a.gen})
            print(res["decode"][-1], flush=True)
    fp["fallback_warnings"] = fallbacks.seen
    if fallbacks.seen:
        print(f"hf_bench: {len(fallbacks.seen)} kernel(s) ran their PyTorch reference: " + " | ".join(fallbacks.seen), file=sys.stderr, flush=True)
    print(json.dumps(res))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""The `hfcp` console command. `hfcp verify ...`: see hfcp.commands.verify; `hfcp plan ...`: hfcp.commands.plan."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hfcp", description="hfcp: exact context parallelism for Hugging Face models")
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check the patched model against the unpatched one (exit 1 if not exact)")
    v.add_argument("--model", required=True, help="a checkpoint directory, or a model_type (a tiny random model)")
    v.add_argument("--seq-len", type=int, default=512,
                   help="tokens (a tiny random model with a learned position table, gpt2 or bert, holds 256)")
    v.add_argument("--cp-size", type=int, default=2, help="processes to start (one CP group)")
    v.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses", "usp"])
    v.add_argument("--data", help="a text file (tokenized with the checkpoint's tokenizer); default: random ids")
    from .verify_inputs import HEADS

    v.add_argument("--head", choices=list(HEADS),
                   help="a model_type's tiny model with the family's class of that head (a checkpoint: its own class, "
                        "which must be of it); default: the causal LM")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    from .plan import add_parser, run

    add_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "plan":
        return run(args, ap.error)
    if args.seq_len < 2 or args.cp_size < 2:
        ap.error(f"--seq-len {args.seq_len} must be at least 2 and --cp-size {args.cp_size} at least 2")

    from .verify import GRAD_TOL, LOGIT_TOL, LOSS_TOL, VerifyError, verify

    try:
        report = verify(args.model, args.seq_len, args.cp_size, args.strategy, args.data, args.head)
    except VerifyError as e:  # one line, no traceback: 2 bad arguments (as argparse), 1 no verdict
        print(f"hfcp verify: {'error: ' if e.exit_status == 2 else ''}{e}", file=sys.stderr)
        return e.exit_status
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        head = f" ({report.head})" if report.head else ""
        print(f"hfcp verify: {report.model}{head}, {report.seq_len} tokens, cp {report.cp_size}, {report.strategy}: "
              f"{report.verdict.upper()}")
        if report.reason:
            print(f"  {report.reason}")
        else:
            print(f"  loss rel. error {report.loss_err:.2e} (tol {LOSS_TOL:g}), worst gradient {report.grad_err:.2e} "
                  f"(tol {GRAD_TOL:g}), logits {report.logit_err:.2e} (tol {LOGIT_TOL:g}) against the fp32 model")
            if report.fp64:
                h, r = report.fp64["hfcp"], report.fp64["fp32_reference"]
                print(f"  against float64: hfcp loss {h['loss']:.2e}, grad {h['grad']:.2e}; "
                      f"the fp32 reference loss {r['loss']:.2e}, grad {r['grad']:.2e}")
            print(f"  peak memory per rank (MB; on CPU the process's peak RSS, reference included): "
                  f"{', '.join(f'{m:.0f}' for m in report.peak_mem_mb)}")
    return 0 if report.verdict == "exact" else 1


if __name__ == "__main__":
    sys.exit(main())

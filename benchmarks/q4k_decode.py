"""``gpu_bench.py``'s ``--q4k-decode`` and ``--gluon-*`` flags (issue #28): which decode a native GGUF's
Q4_K (and Q6_K) products take in a benchmark process, and the Gluon decode's settings (``quant_gluon``'s module
constants) for a variant timed beside the engine's own, refused where they would do nothing (exit 2)."""

from __future__ import annotations

import argparse


def add_flags(ap: argparse.ArgumentParser) -> None:
    """``--q4k-decode`` and the Gluon decode's ``--gluon-*`` flags."""
    ap.add_argument("--q4k-decode", choices=["engine", "kernel", "packed", "gluon", "gluon-pairs", "gluon-pairs-ahead"],
                    default="engine",
                    help="engine: as the engine loads (on an sm_90 GPU in bf16 Q4_K, Q6_K and Q4_1 held as the planes "
                         "of the decode into operand registers, engine/models/quant_gluon.py; issue #28); kernel: "
                         "every format in its blocks through quant_kernel (ENGINE_QUANT_DECODE=kernel); packed: the "
                         "Q4_K products through the bf16-pair decode prototype (benchmarks/quant_packed.py); gluon: "
                         "through the operand-register decode with a benchmark's options (benchmarks/quant_gluon.py: "
                         "the float decode; gluon-pairs: the pair decode, Q6_K too; -ahead: x read an iteration "
                         "ahead); the last four load as kernel does")
    ap.add_argument("--gluon-warps", type=int, choices=[4, 8], default=None,
                    help="--q4k-decode gluon*: every launch on this many warps (a 64- or 128-row tile; default 8 for "
                         "32 rows or more, else 4)")
    ap.add_argument("--gluon-min-rows", type=int, choices=[8, 16], default=None,
                    help="--q4k-decode engine or gluon*: a launch's fewest rows a program (quant_gluon.MIN_BLOCK_M; "
                         "8, the engine's: 1-8 rows on wgmma's narrowest N, fewer registers; 16: as before "
                         "2026-12-06's tenth session)")
    ap.add_argument("--gluon-stages", type=int, choices=[0, 2, 3, 4, 5, 6], default=None,
                    help="--q4k-decode engine or gluon-pairs: every Q4_K, Q6_K and Q4_1 product's tiles through "
                         "shared memory in this many stages, one less copied ahead (quant_gluon.STAGES; 0: the "
                         "register path for every launch; default the engine's: staged only where "
                         "--gluon-few-rows-stages' rule says)")
    ap.add_argument("--gluon-few-rows-stages", type=int, choices=[0, 2, 3, 4, 5, 6, 8], default=None,
                    help="--q4k-decode engine or gluon-pairs: a launch of at most MIN_BLOCK_M rows (an AR step's) with "
                         "its part's tiles in flight through shared memory, up to this many stages "
                         "(quant_gluon.FEW_ROWS_STAGES; 0: the register path; default the engine's)")
    ap.add_argument("--gluon-staged-rows", type=int, choices=[8, 16, 32, 64], default=None,
                    help="--q4k-decode engine or gluon-pairs: the most rows a launch takes --gluon-few-rows-stages' "
                         "rule at (quant_gluon.STAGED_ROWS; default the engine's, MIN_BLOCK_M: an AR step's; 64: "
                         "a verify's launches of fewer programs than SMs too, without a tail)")
    ap.add_argument("--gluon-tails", choices=["on", "off", "16"], default=None,
                    help="--q4k-decode engine or gluon*: 33-48 rows as 32 and a tail of 8 or 16, two products of one "
                         "decoded tile (quant_gluon.TAILS; on: the engine's since 2026-12-07), 16: 17-24 rows as "
                         "16 + 8 too (TAIL_FROM 32), off: the power of two")
    ap.add_argument("--gluon-maxnreg", type=int, choices=[0, 128, 168], default=None,
                    help="--q4k-decode engine or gluon*: registers a thread at most for a tail's 8-warp launches "
                         "(quant_gluon.MAXNREG; 128 the engine's; 0: as ptxas allots them)")
    ap.add_argument("--gluon-wide-warps", type=int, choices=[8, 16], default=None,
                    help="--q4k-decode engine or gluon*: the warps of a launch of 32 rows a program or more (a "
                         "verify's) where the weight's padded rows are whole tiles of theirs (quant_gluon.WIDE_WARPS; "
                         "8: 128-row tiles, the engine's; 16: 256-row tiles, x read half as often)")
    ap.add_argument("--gluon-fold-from", type=int, choices=[0, 16, 32], default=None,
                    help="--q4k-decode engine or gluon*: the fewest rows a program (up to 32) from which a Q4_K or "
                         "Q4_1 launch takes two of an even split's parts a program, the program adding them "
                         "(quant_gluon.FOLD_FROM; 32: a verify's 8-warp launches; 0: never, the engine's: its bits "
                         "tested on a GPU, no gain measured at 4 programs an SM)")
    ap.add_argument("--gluon-programs-per-sm", type=int, choices=[4, 8, 12, 16], default=None,
                    help="--q4k-decode engine or gluon*: split_for's aim, a weight's 1-row launch spread over about "
                         "this many programs an SM, Q6_K's aside (quant_gluon.PROGRAMS_PER_SM; 4 the engine's; 8: "
                         "the 27B's 1-row launches faster alone, its AR step slower, 2026-12-07); it sets the "
                         "weight's split for every launch, so its bits")
    ap.add_argument("--gluon-verify-sliver", type=int, choices=[0, 4, 8, 16], default=None,
                    help="--q4k-decode engine: a Q4_K or Q4_1 weight whose verify launch (32 rows a program) would "
                         "spill at most 1/N of a wave past whole waves takes twice the aim's parts, its other launches "
                         "folding them in pairs (quant_gluon.VERIFY_SLIVER; 0: never, the engine's); it sets the "
                         "weight's split, so its bits")
    ap.add_argument("--gluon-pdl", choices=["on", "off"], default=None,
                    help="--q4k-decode engine or gluon*: its launches with programmatic dependent launch or not "
                         "(quant_gluon.PDL: each asks for its weight's tiles as the kernel before it runs; on: the "
                         "engine's since 2026-12-07)")


def settings(args: argparse.Namespace) -> dict:
    """The Gluon decode's module settings the flags ask for (those not asked for stay the engine's)."""
    tails = {None: {}, "on": {"TAILS": True}, "off": {"TAILS": False}, "16": {"TAILS": True, "TAIL_FROM": 32}}
    pdl = {None: None, "on": True, "off": False}[args.gluon_pdl]
    asked = {"MIN_BLOCK_M": args.gluon_min_rows, "STAGES": args.gluon_stages, "PDL": pdl,
             "FEW_ROWS_STAGES": args.gluon_few_rows_stages, "STAGED_ROWS": args.gluon_staged_rows,
             "WIDE_WARPS": args.gluon_wide_warps, "PROGRAMS_PER_SM": args.gluon_programs_per_sm}
    chosen = {name: value for name, value in asked.items() if value is not None} | tails[args.gluon_tails]
    if args.gluon_fold_from is not None:  # (0: never)
        chosen["FOLD_FROM"] = args.gluon_fold_from or None
    if args.gluon_verify_sliver is not None:  # (0: never)
        chosen["VERIFY_SLIVER"] = args.gluon_verify_sliver or None
    if args.gluon_maxnreg is not None:  # (0: as ptxas allots them)
        chosen["MAXNREG"] = args.gluon_maxnreg or None
    return chosen


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The Gluon decode's own flags refused where they would do nothing (exit 2): with any other --q4k-decode, a
    register cap with no tail to cap, shared-memory stages with a decode that has none."""
    if not args.q4k_decode.startswith("gluon") and args.gluon_warps is not None:
        ap.error(f"--gluon-warps: a setting of the Gluon decode, not of --q4k-decode {args.q4k_decode}")
    for flag in ("gluon_min_rows", "gluon_stages", "gluon_few_rows_stages", "gluon_staged_rows", "gluon_pdl",
                 "gluon_tails", "gluon_maxnreg", "gluon_wide_warps", "gluon_fold_from", "gluon_programs_per_sm",
                 "gluon_verify_sliver"):
        value = getattr(args, flag)
        if args.q4k_decode in ("kernel", "packed") and value is not None:
            ap.error(f"--{flag.replace('_', '-')}: a setting of the Gluon decode (engine or gluon*), not of "
                     f"--q4k-decode {args.q4k_decode}")
    if args.gluon_wide_warps == 16 and ((args.gluon_stages or 0) > 1 or args.gluon_warps is not None):
        ap.error("--gluon-wide-warps 16: a verify's launches on the register path at the engine's own warps, not "
                 f"with --gluon-stages {args.gluon_stages} or --gluon-warps {args.gluon_warps} (every launch then "
                 "takes those)")
    if args.gluon_verify_sliver:
        if args.q4k_decode != "engine":
            ap.error(f"--gluon-verify-sliver {args.gluon_verify_sliver}: the engine's weights fold the doubled "
                     f"parts (OperandWeight), not --q4k-decode {args.q4k_decode}'s launches")
        clash = [f for f, bad in (("--gluon-tails off", args.gluon_tails == "off"),
                                  (f"--gluon-stages {args.gluon_stages}", (args.gluon_stages or 0) > 1),
                                  ("--gluon-maxnreg 0", args.gluon_maxnreg == 0)) if bad]
        if clash:
            ap.error(f"--gluon-verify-sliver {args.gluon_verify_sliver} with {clash[0]}: its rule counts a verify's "
                     "launch as 32 rows and a tail at two programs an SM on the register path")
    if args.gluon_maxnreg is not None and args.gluon_tails == "off":
        ap.error(f"--gluon-maxnreg {args.gluon_maxnreg}: it caps a tail's launch, and --gluon-tails off takes none")
    for flag in ("gluon_stages", "gluon_few_rows_stages"):
        if (getattr(args, flag) or 0) > 1 and args.q4k_decode in ("gluon", "gluon-pairs-ahead"):
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: shared-memory stages take the pair decode "
                     f"with x staged beside the planes (--q4k-decode engine or gluon-pairs), not --q4k-decode "
                     f"{args.q4k_decode}")


def apply(args: argparse.Namespace) -> None:
    """The decode asked for, for this process: the blocks kept for ``quant_kernel`` (or a prototype that replaces
    it) where not ``engine``, and the Gluon decode's settings (those not asked for stay the engine's)."""
    from engine.models import fused
    from engine.models import quant_gluon as engine_gluon

    if args.q4k_decode != "engine":  # the blocks kept for quant_kernel (or the prototypes that replace it)
        fused.set_quant_decode("kernel")  # (the engine read ENGINE_QUANT_DECODE when gpu_bench imported it)
    if args.q4k_decode == "packed":
        import quant_packed

        quant_packed.install()
    elif args.q4k_decode.startswith("gluon"):
        import quant_gluon

        quant_gluon.install(pairs=args.q4k_decode != "gluon", x_ahead=args.q4k_decode.endswith("-ahead"),
                            warps=args.gluon_warps)
    for name, value in settings(args).items():
        setattr(engine_gluon, name, value)

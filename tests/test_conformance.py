"""The conformance suites run as a third party runs them: `pytest --pyargs moeplex.conformance` in a fresh process.

Each run starts in an empty folder, so neither this project's pytest settings nor its
conftest apply; plugins are found only through installed entry points.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from moeplex import registry
from moeplex.interfaces import PluginError
from moeplex.plugins.kv_transfer.nixl import load_nixl

RUN_TIMEOUT_S = 600
EXAMPLE_SETUP = "bash scripts/setup.sh (it runs pip install -e examples/moeplex-example-plugins)"
BROKEN_KERNELS = {
    "forgets_weights": "ForgetsWeights",
    "drops_last_token": "DropsLastToken",
    "reads_missing_ids_as_last_expert": "ReadsMissingIdsAsLastExpert",
}

BROKEN_MODULE = '''
"""MoE kernels with the bugs the conformance suite exists to catch."""
import torch
import torch.nn.functional as F
from moeplex.interfaces import STANDARD, ExpertOutput, KernelCaps, MoEKernel


class ForgetsWeights(MoEKernel):
    caps = KernelCaps(layouts=frozenset({STANDARD}), dtypes=frozenset({torch.float32, torch.float16}))
    use_weights, skip_missing_ids, drop_last = False, True, False

    def prepare_weights(self, weights):
        return weights.w13, weights.w2

    def apply(self, layout, weights):
        w13, w2 = weights
        out = torch.zeros_like(layout.hidden)
        rows = layout.num_rows - 1 if self.drop_last else layout.num_rows
        for token in range(rows):
            for k, expert in enumerate(layout.topk_ids[token].tolist()):
                if expert < 0 and self.skip_missing_ids:
                    continue
                gate, up = (w13[expert] @ layout.hidden[token]).chunk(2)
                weight = layout.topk_weights[token, k] if self.use_weights else 1.0
                out[token] += weight * (w2[expert] @ (F.silu(gate) * up))
        return ExpertOutput(out, weights_applied=True, summed=True)


class DropsLastToken(ForgetsWeights):
    use_weights, skip_missing_ids, drop_last = True, True, True


class ReadsMissingIdsAsLastExpert(ForgetsWeights):
    use_weights, skip_missing_ids, drop_last = True, False, False
'''


def run_suite(*args: str, cwd, pythonpath=None) -> subprocess.CompletedProcess:
    return run_suites([args], cwd=cwd, pythonpath=pythonpath)[0]


def run_suites(arg_lists, cwd, pythonpath=None) -> list[subprocess.CompletedProcess]:
    """One pytest run per argument list, side by side (each mostly waits on one core: a suite under the Triton
    interpreter, say, beside the rest)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tiny tensors: more threads only wait on each other
    env.pop("PYTEST_ADDOPTS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    runs = []
    for args in arg_lists:  # output to files: a full pipe would stop a suite while the other is waited for
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfE", *args]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        runs.append((command, subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True), out, err))
    done = []
    try:
        for command, process, out, err in runs:
            process.wait(timeout=RUN_TIMEOUT_S)
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(command, process.returncode, out.read(), err.read()))
    finally:
        for _, process, out, err in runs:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()
    return done


def conformance(*args: str, cwd, pythonpath=None) -> subprocess.CompletedProcess:
    return run_suite("--pyargs", "moeplex.conformance", *args, cwd=cwd, pythonpath=pythonpath)


def summary(result: subprocess.CompletedProcess) -> dict[str, int]:
    """{'passed': 3, 'failed': 1, ...} from pytest's last line, e.g. '3 passed, 1 failed in 2.0s'."""
    last = result.stdout.strip().splitlines()[-1]
    return {word: int(count) for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


def outcomes(result: subprocess.CompletedProcess) -> list[tuple[str, str, str]]:
    """(module, test id with parameters, outcome) of every test line of a -v run."""
    found = re.findall(r"^\S*?(test_\w+)\.py::(\w+\[[^\]]*\]) (PASSED|FAILED|SKIPPED|ERROR)", result.stdout, re.M)
    return [(module, test, outcome) for module, test, outcome in found]


def report(result: subprocess.CompletedProcess) -> str:
    return f"exit code {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


def selection_args(plugins: list[tuple[str, str]]) -> list[str]:
    return [arg for kind, name in plugins for arg in ("--moeplex-plugin", f"{kind}:{name}")]


def builtin_plugins() -> list[tuple[str, str]]:
    return [
        (kind, name)
        for kind in registry.KINDS
        for name, info in registry.discover(kind).items()
        if info.distribution == "moeplex"
    ]


def write_broken_package(folder) -> None:
    """A module plus the .dist-info an installer would write, so importlib.metadata finds its entry points."""
    (folder / "broken_moeplex_plugin.py").write_text(BROKEN_MODULE)
    info = folder / "broken_moeplex_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-moeplex-plugin\nVersion: 0.1\n")
    entry_points = "".join(f"{name} = broken_moeplex_plugin:{cls}\n" for name, cls in BROKEN_KERNELS.items())
    (info / "entry_points.txt").write_text(f"[moeplex.moe_kernels]\n{entry_points}")


@pytest.mark.slow
def test_every_builtin_plugin_passes(tmp_path):
    plugins = builtin_plugins()
    # the Triton kernels' suite runs under the interpreter for most of the time: in two halves (its masked layout,
    # the rest) beside the other plugins' suites
    triton = [p for p in plugins if p == ("moe_kernel", "triton")]
    others = ["--pyargs", "moeplex.conformance", *selection_args([p for p in plugins if p not in triton])]
    halves = [["--pyargs", "moeplex.conformance", *selection_args(triton), "-k", k] for k in ("masked", "not masked")]
    results = run_suites([others, *(halves if triton else [])], cwd=tmp_path)
    tested = []
    for result in results:
        assert result.returncode == 0, report(result)
        assert summary(result).get("passed", 0) > 0, report(result)
        tested += outcomes(result)
    both = "\n".join(report(result) for result in results)
    for kind, name in plugins:
        own_id = re.compile(rf"\[{re.escape(name)}[-\]]")  # the plugin is the first parameter: [name-...] or [name]
        ids = [test for module, test, _ in tested if module == f"test_{kind}" and own_id.search(test)]
        assert ids, f"no {kind} test ran on '{name}'\n{both}"
    for name in kv_transfer_backends_that_run_here():  # their whole suite runs here, not only a test or two
        ran = [o for module, test, o in tested if module == "test_kv_transfer" and re.search(rf"\[{name}[-\]]", test)
               and o != "SKIPPED"]
        assert len(ran) >= 15 and set(ran) == {"PASSED"}, f"kv_transfer '{name}': {ran}\n{both}"


def kv_transfer_backends_that_run_here() -> list[str]:
    """The built-in backends whose suite must run and pass on this machine (nixl where its library loads)."""
    names = [name for name in ("loopback", "zmq", "nixl") if name in registry.discover("kv_transfer")]
    try:
        load_nixl()
    except PluginError:
        names = [name for name in names if name != "nixl"]
    return names


@pytest.mark.slow
def test_example_package_kernel_is_found_and_passes(tmp_path):
    assert "dense" in registry.discover("moe_kernel"), (
        f"the example plugin package is not installed; run the project's test set-up: {EXAMPLE_SETUP}"
    )
    result = conformance("--moeplex-plugin", "moe_kernel:dense", cwd=tmp_path)
    assert result.returncode == 0, report(result)
    assert summary(result).get("passed", 0) > 0, report(result)
    tested = outcomes(result)
    assert tested and all(module == "test_moe_kernel" and "[dense-" in test for module, test, _ in tested), (
        f"a run selecting moe_kernel:dense ran other tests\n{report(result)}"
    )


@pytest.mark.slow
def test_broken_kernels_fail_and_the_reference_passes_beside_them(tmp_path):
    """One run selects the broken kernels and the torch reference together (one fresh process, not two): each
    broken kernel fails, and every test of the reference, run in the same process beside them, passes."""
    write_broken_package(tmp_path)
    selection = selection_args([("moe_kernel", name) for name in BROKEN_KERNELS] + [("moe_kernel", "torch")])
    broken = conformance(*selection, cwd=tmp_path, pythonpath=tmp_path)
    assert broken.returncode == 1, report(broken)
    tested = outcomes(broken)
    failed = [test for _, test, outcome in tested if outcome == "FAILED"]
    for name in BROKEN_KERNELS:
        assert any(test.startswith(f"test_matches_torch_reference[{name}-") for test in failed), (
            f"the suite did not catch '{name}'\n{report(broken)}"
        )
    reference = [outcome for _, test, outcome in tested if re.search(r"\[torch[-\]]", test)]
    assert "PASSED" in reference and set(reference) <= {"PASSED", "SKIPPED"}, report(broken)


@pytest.mark.parametrize(
    "value, named",
    [
        ("moe_kernel:no-such-kernel", ["no moe_kernel named 'no-such-kernel'", "installed moe_kernels:", "torch"]),
        ("dispatcher:no-such-dispatcher", ["installed dispatchers:", "local"]),
        ("kernel:torch", ["unknown plugin kind 'kernel'", "dispatcher, moe_kernel, balancer, overlap"]),
    ],
)
def test_unknown_plugin_is_a_usage_error_naming_what_is_installed(tmp_path, value, named):
    result = conformance("--moeplex-plugin", value, cwd=tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, report(result)
    for text in named:
        assert text in result.stderr, report(result)


def test_plugin_leaves_other_test_modules_alone(tmp_path):
    """A project's own test_dispatcher.py, with its own `moeplex_plugin` fixture, runs untouched."""
    (tmp_path / "test_dispatcher.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def moeplex_plugin():
                return "mine"

            def test_own_fixture(moeplex_plugin):
                assert moeplex_plugin == "mine"
            """
        )
    )
    result = run_suite("test_dispatcher.py", "--moeplex-plugin", "moe_kernel:torch", cwd=tmp_path)
    assert result.returncode == 0, report(result)
    assert summary(result) == {"passed": 1}, report(result)

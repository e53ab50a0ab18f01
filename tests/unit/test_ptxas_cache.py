"""The ptxas cache's script, against a stand-in ptxas that logs its runs, and against the real one where the
machine has it: a hit gives the bytes ptxas gives, with its output replayed; anything else runs ptxas."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from jaxmem.runtime import ptxas_cache

FAKE = """#!/bin/sh
# a stand-in ptxas: --version, or `IN -o OUT FLAGS...`; OUT holds the flags and IN, and each run is logged
if [ "$1" = "--version" ]; then echo "fake ptxas, release 1.0"; exit 0; fi
echo run >> "$(dirname "$0")/runs.log"
grep -q FAIL "$1" && { echo "ptxas fatal: bad input" >&2; exit 255; }
in=$1; out=$3; shift 3
{ echo "$*"; cat "$in"; } > "$out"
echo "ptxas info: compiled"
echo "ptxas warning: 8 bytes spill stores" >&2
"""

KERNEL = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n ret;\n}\n"


@pytest.fixture
def fake_ptxas(tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "ptxas").write_text(FAKE)
    (tools / "ptxas").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(ptxas_cache.ENV, str(tmp_path / "it's a cache"))  # quotes and spaces survive the script
    monkeypatch.setattr(ptxas_cache, "_jax_cuda_root", lambda: None)
    cache = ptxas_cache.install()
    return cache, tools


def _ptxas(tmp_path, source: str, *flags, out="k.cubin"):
    (tmp_path / "k.ptx").write_text(source)
    done = subprocess.run(["ptxas", str(tmp_path / "k.ptx"), "-o", str(tmp_path / out), *flags],
                          capture_output=True, text=True)
    return done, (tmp_path / out).read_bytes() if (tmp_path / out).exists() else None


def _runs(tools) -> int:
    log = tools / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_second_identical_call_is_served_from_the_cache_with_ptxas_output(tmp_path, fake_ptxas):
    cache, tools = fake_ptxas
    assert os.environ["PATH"].split(os.pathsep)[0] == str(cache / "cuda" / "bin")
    first, cubin = _ptxas(tmp_path, KERNEL, "-arch=sm_90a", "--warn-on-spills")
    again, cached = _ptxas(tmp_path, KERNEL, "-arch=sm_90a", "--warn-on-spills", out="again.cubin")
    assert first.returncode == again.returncode == 0
    assert _runs(tools) == 1 and ptxas_cache.hits(cache) == 1
    assert cached == cubin and cubin.startswith(b"-arch=sm_90a --warn-on-spills")
    assert (again.stdout, again.stderr) == (first.stdout, first.stderr) == (
        "ptxas info: compiled\n", "ptxas warning: 8 bytes spill stores\n")


def test_other_arguments_or_another_kernel_run_ptxas(tmp_path, fake_ptxas):
    cache, tools = fake_ptxas
    _ptxas(tmp_path, KERNEL, "-arch=sm_90a")
    _, other_arch = _ptxas(tmp_path, KERNEL, "-arch=sm_80")
    _, other_kernel = _ptxas(tmp_path, KERNEL.replace("k()", "k2()"), "-arch=sm_90a")
    assert _runs(tools) == 3 and ptxas_cache.hits(cache) == 0
    assert other_arch.startswith(b"-arch=sm_80") and b"k2()" in other_kernel


def test_a_failed_compile_is_not_kept(tmp_path, fake_ptxas):
    cache, tools = fake_ptxas
    for _ in range(2):
        done, _ = _ptxas(tmp_path, KERNEL + "// FAIL\n", "-arch=sm_90a")
        assert done.returncode == 255 and done.stderr == "ptxas fatal: bad input\n"
    assert _runs(tools) == 2 and ptxas_cache.hits(cache) == 0
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]


def test_without_a_key_the_real_ptxas_runs_in_its_place(tmp_path, fake_ptxas, monkeypatch):
    cache, tools = fake_ptxas
    broken = tmp_path / "broken"  # a sha256sum that cannot run, as when a fork fails
    broken.mkdir()
    (broken / "sha256sum").write_text("#!/bin/sh\nexit 1\n")
    (broken / "sha256sum").chmod(0o755)
    monkeypatch.setenv("PATH", f"{broken}{os.pathsep}{os.environ['PATH']}")
    for kernel in (KERNEL, KERNEL.replace("k()", "k2()")):  # an empty key must not serve one kernel for all
        done, cubin = _ptxas(tmp_path, kernel, "-arch=sm_90a")
        assert done.returncode == 0 and cubin == f"-arch=sm_90a\n{kernel}".encode()
        assert (done.stdout, done.stderr) == ("ptxas info: compiled\n", "ptxas warning: 8 bytes spill stores\n")
    assert _runs(tools) == 2 and not [p for p in cache.rglob("*") if p.name.endswith(".cubin")]


def test_the_script_runs_under_bash_where_there_is_one(fake_ptxas):
    cache, _ = fake_ptxas
    first_line = (cache / "cuda" / "bin" / "ptxas").read_text().splitlines()[0]
    assert first_line == ("#!/bin/bash" if os.access("/bin/bash", os.X_OK) else "#!/bin/sh")


def test_calls_it_does_not_understand_go_to_ptxas(tmp_path, fake_ptxas):
    _, tools = fake_ptxas
    assert subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout == \
        "fake ptxas, release 1.0\n"
    assert _runs(tools) == 0


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ptxas_cache.ENV, raising=False)
    path = os.environ["PATH"]
    assert ptxas_cache.install() is None and os.environ["PATH"] == path


def test_a_hit_is_the_real_ptxas_cubin_byte_for_byte(tmp_path, monkeypatch):
    real = shutil.which("ptxas") or ("/usr/local/cuda/bin/ptxas" if Path("/usr/local/cuda/bin/ptxas").exists()
                                     else None)
    if real is None:
        pytest.skip("no ptxas on this machine")
    monkeypatch.setenv(ptxas_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(ptxas_cache, "_jax_cuda_root", lambda: None)
    cache = ptxas_cache.install()
    (tmp_path / "k.ptx").write_text(KERNEL)
    direct = subprocess.run([real, str(tmp_path / "k.ptx"), "-o", str(tmp_path / "direct.cubin"),
                             "-arch=sm_90a"], capture_output=True)
    assert direct.returncode == 0
    for name in ("miss", "hit"):
        _ptxas(tmp_path, KERNEL, "-arch=sm_90a", out=f"{name}.cubin")
    assert ptxas_cache.hits(cache) == 1
    want = (tmp_path / "direct.cubin").read_bytes()
    assert (tmp_path / "miss.cubin").read_bytes() == want == (tmp_path / "hit.cubin").read_bytes()


def test_sweep_and_tune_turn_it_on_for_their_workers_unless_it_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv(ptxas_cache.ENV, raising=False)
    wanted = tmp_path / "cache" / "ptxas"
    with ptxas_cache.defaulted_to(wanted) as folder:
        assert os.environ[ptxas_cache.ENV] == str(wanted) and folder == wanted
    assert ptxas_cache.ENV not in os.environ
    monkeypatch.setenv(ptxas_cache.ENV, str(tmp_path / "mine"))
    with ptxas_cache.defaulted_to(tmp_path / "cache" / "ptxas") as folder:
        assert os.environ[ptxas_cache.ENV] == str(tmp_path / "mine") and folder == tmp_path / "mine"
    assert os.environ[ptxas_cache.ENV] == str(tmp_path / "mine")

"""The memory timeline (`jaxmem explain --html/--plot/--timeline-json`, `jaxmem bench --html`).

Two deviceless compiles serve the module (8 x h100-80g): the tiny config with every kind of buffer at its
peak (explain's test overrides), its dump kept; and the tiny config next to an offloaded one (--compare).
The timeline is checked against XLA's own files read independently here (the live-range table, the buffer
assignment, XLA's listed peak), against explain's peak, and rendered in headless Chromium where installed.
"""
import json
import re
import shutil
import subprocess

import pytest

from jaxmem.loader import load_config
from jaxmem.plan import hlo_dump, timeline as tl_mod, timeline_html
from jaxmem.cli.explain import main

pytestmark = pytest.mark.slow  # the compiled steps whose timelines every test here draws

OVERRIDES = ["parallel.fsdp=8", "model.vocab_size=32768", "train.seq_len=256", "kernels.loss=naive",
             "remat.preset=selective", "train.grad_accum=2", "target.name=h100-80g"]
OFFLOAD = ["remat.preset=offload_layer_inputs", "offload.optimizer=host", "offload.optimizer_update=host"]
PLAIN = ["parallel.fsdp=8", "target.name=h100-80g"]


@pytest.fixture(scope="module")
def run(built_once):
    """(directory, timeline, explain's --json): the CLI once with every timeline output, the dump kept."""
    def build(d):
        assert main(["configs/tiny.yaml", *OVERRIDES, "--top", "1000", "--json", str(d / "top.json"),
                     "--dump-dir", str(d / "dump"), "--html", str(d / "t.html"), "--plot", str(d / "t.png"),
                     "--timeline-json", str(d / "t.json")]) == 0

    d = built_once("timeline", build)
    return d, json.loads((d / "t.json").read_text()), json.loads((d / "top.json").read_text())


@pytest.fixture(scope="module")
def compared(built_once):
    """(directory, [plain, offloaded] timelines): --compare with an offloaded config."""
    def build(d):
        assert main(["configs/tiny.yaml", *PLAIN, "--compare", "configs/tiny.yaml", *sum((["--compare-set", o]
                     for o in OFFLOAD), []), "--html", str(d / "c.html"), "--timeline-json", str(d / "c.json")]) == 0

    d = built_once("timeline-compare", build)
    return d, json.loads((d / "c.json").read_text())


def _xla_files(d):
    _, live, _ = hlo_dump.find_dump(d / "dump")
    return live.read_text(), hlo_dump.buffer_assignment_path(live).read_text()


# ------------------------------------------------------------------ the data against XLA's files


def test_the_live_set_equals_xlas_where_xla_lists_one(run):
    """XLA's live-range file lists the values live at one moment (its "(peak)"): the timeline's bands live then
    hold exactly those values, and as many bytes once an in-place pair is counted once (XLA lists an op that
    writes into its operand's buffer, a scatter here, next to that operand: the same bytes twice)."""
    d, tl, _ = run
    text, assignment = _xla_files(d)
    moment = int(re.search(r"Live ranges at (\d+) \(peak\)", text).group(1))
    xla = {n + i: b for n, i, b in hlo_dump.peak_buffers(text)}
    live = tl_mod.live_at(tl, moment, "device") + tl_mod.live_at(tl, moment, "host")
    ours = {v for b in live for v in b["values"]}
    assert set(xla) <= ours
    assert all(set(b["values"]) & set(xla) for b in live)  # every live band is one XLA lists
    regions = hlo_dump.value_regions(assignment)
    assert sum(b["bytes"] for b in live) == sum(r.bytes for r in {regions[v] for v in xla}) > 0
    assert all(xla[v] == regions[v].bytes for v in xla)


def test_every_position_matches_the_live_range_table(run):
    """At every schedule position, each pool's total equals a plain count over XLA's live-range table and
    buffer assignment: the bytes of each (allocation, offset) with a value live then, counted once."""
    d, tl, _ = run
    text, assignment = _xla_files(d)
    regions = hlo_dump.value_regions(assignment)
    ranges = [(regions[n + i], a, b) for n, i, a, b in hlo_dump.live_ranges(text) if n + i in regions]
    assert len(ranges) > 300 and tl["positions"] == len(tl["instructions"]) > 500
    for t in range(tl["positions"]):
        live = {r for r, a, b in ranges if a <= t <= b}
        assert tl["device"]["total"][t] == sum(r.bytes for r in live if not r.host), t
        assert tl["host"]["total"][t] == sum(r.bytes for r in live if r.host), t


def test_the_maximum_is_explains_device_peak_and_lists_its_buffers(run):
    _, tl, top = run
    assert max(tl["device"]["total"]) == tl["peak"]["device_bytes"] == top["peak_live_bytes"]
    assert tl["device"]["total"][tl["peak"]["position"]] == top["peak_live_bytes"]
    assert [(b["buffer"], b["bytes"]) for b in tl["peak"]["buffers"]] == \
        [(b["buffer"], b["bytes"]) for b in top["buffers"]]
    assert sum(b["bytes"] for b in tl["peak"]["buffers"]) == top["peak_live_bytes"]
    assert tl["compiled_device_bytes"] == top["compiled_device_bytes"] >= top["peak_live_bytes"]


def test_a_parameter_updated_in_place_is_drawn_as_a_parameter(run):
    """A band whose region holds a step argument is classified by it: the bf16 params, which the update
    writes over in place, are parameters for the whole step (they were drawn as optimizer state)."""
    d, tl, _ = run
    module = hlo_dump.HloModuleText(hlo_dump.find_dump(d / "dump")[0].read_text())
    entry = {name: ins.op_name for name, ins in module.instrs.items()
             if ins.opcode == "parameter" and ins.computation == module.entry}
    holding = [(b, entry[v.split("{")[0]]) for b in tl["bands"] for v in b["values"] if v.split("{")[0] in entry]
    params = [b for b, path in holding if path.startswith("state['params']")]
    assert params and all(b["category"] == "param" for b in params), {b["category"] for b in params}
    assert any(b["category"] == "optimizer" for b, path in holding if path.startswith("state['opt']"))


def test_categories_sum_to_the_total_everywhere(run):
    _, tl, _ = run
    for pool in ("device", "host"):
        by = tl[pool]["by_category"]
        assert set(by) == set(tl_mod.CATEGORIES)
        for t in range(tl["positions"]):
            assert sum(by[c][t] for c in by) == tl[pool]["total"][t]
    peak = tl["peak"]["position"]
    # this step's peak holds every kind explain knows (its test config's premise), all on the device
    at_peak = {c for c in tl_mod.CATEGORIES if tl["device"]["by_category"][c][peak]}
    assert {"param", "grad", "optimizer", "activation", "logits", "temp"} <= at_peak
    assert all(b["category"] in tl_mod.CATEGORIES and b["memory"] in ("device", "host") for b in tl["bands"])


def test_bands_carry_what_the_page_shows(run):
    _, tl, _ = run
    act = [b for b in tl["bands"] if b["category"] == "activation" and b["checkpoint_name"]]
    assert act and all(b["source"].startswith("jaxmem/") and "remat.names." in b["suggestion"] for b in act)
    logits = max((b for b in tl["bands"] if b["category"] == "logits"), key=lambda b: b["bytes"])
    assert logits["shape"] == [2 * 256, 32768] and logits["dtype"] == "f32" and logits["bytes"] == 512 * 32768 * 4
    for b in tl["bands"]:
        assert 0 <= b["first"] <= b["last"] < tl["positions"] and b["bytes"] > 0 and b["values"]


def test_the_step_is_split_into_its_parts_in_order(run):
    _, tl, _ = run
    ph = tl["phases"]
    assert ph[0]["first"] == 0 and ph[-1]["last"] == tl["positions"] - 1
    assert all(a["last"] + 1 == b["first"] for a, b in zip(ph, ph[1:]))
    first = {}
    for p in ph:
        first.setdefault(p["name"], p["first"])
    assert first["forward layers"] < first["loss"] < first["backward layers"] < first["update"]
    assert tl["peak"]["phase"] in {p["name"] for p in ph}


def test_the_embeddings_gradient_table_is_made_after_the_layers_backward(compared):
    """On a mesh the [vocab, d] table the lookup's gradient is scatter-added into exists only once the layers'
    backward is done: made from nothing, XLA's scheduler had placed its zeros early to hide a collective
    (Llama-3-8B on 8 x H100: 1.96 GiB of fp32 live through the layers' backward)."""
    m = load_config("configs/tiny.yaml").model
    for tl in compared[1]:
        end = max(p["last"] for p in tl["phases"] if p["name"] == "backward layers")
        tables = [b for b in tl["bands"] if b["memory"] == "device" and b["shape"] == [m.vocab_size, m.d_model]
                  and "scatter" in b["op"] and "transpose" in b["op"]]
        assert tables and all(b["first"] > end for b in tables), [(b["first"], end, b["op"]) for b in tables]


def test_an_offloaded_step_has_a_host_lane_and_host_copies(compared):
    _, (plain, off) = compared
    assert plain["host_peak_bytes"] == 0 and not any(b["memory"] == "host" for b in plain["bands"])
    assert off["host_peak_bytes"] > 0 and any(b["memory"] == "host" for b in off["bands"])
    assert any(b["category"] == "host_copy" and b["memory"] == "device" for b in off["bands"])
    assert off["peak"]["device_bytes"] < plain["peak"]["device_bytes"]
    assert off["peak"]["host_bytes"] == off["host"]["total"][off["peak"]["position"]]
    assert "offload.optimizer=host" in off["config"]


def test_the_lm_heads_gradient_is_reduced_before_the_layers_backward(compared):
    """The fused loss's per-device partial dW [D, V] dies before the layers' backward starts, in both steps:
    XLA left its reduction until the update reads it (Llama-3-8B on 8 x H100, ladder rung 5: 1 GiB more at
    the peak) until the loss's backward released dh only with the reduced dW."""
    _, timelines = compared
    m = load_config("configs/tiny.yaml").model
    for tl in timelines:
        start = next(p["first"] for p in tl["phases"] if p["name"] == "backward layers")
        partial = [b for b in tl["bands"] if b["memory"] == "device" and b["category"] == "grad"
                   and b["shape"] == [m.d_model, m.vocab_size] and "shard_map" in b["op"]]
        assert partial and all(b["last"] < start for b in partial), [(b["first"], b["last"], start) for b in partial]


# ------------------------------------------------------------------ pure functions on small inputs


def test_bands_merge_aliases_and_split_reuse_of_one_region():
    assignment = "\n".join([
        "allocation 0: size 12000, preallocated-temp:",
        " value: <1 a @0> (size=4000,offset=0): f32[1000]{0}",
        " value: <2 b @0> (size=8000,offset=4000): f32[2000]{0}",
        " value: <3 b_phi{1} (phi) @0> (size=8000,offset=4000): f32[2000]{0}",
        " value: <5 c @0> (size=4000,offset=0): f32[1000]{0}",
        "allocation 1: size 16000, color 5, preallocated-temp:",
        " value: <4 h @5> (size=16000,offset=0): f32[4000]{0:S(5)}"])
    live = "\n".join(["HloLiveRange (max 6):", "  InstructionSequence:", "    0:a", "    1:h", "    2:b", "    3:x",
                      "    5:c", "  BufferLiveRange:", "    a{}:0-1", "    h{}:1-2", "    b{}:2-3",
                      "    b_phi{1}:3-4", "    c{}:5-6", "  Live ranges at 1 (peak):"])
    got = [(b.values, b.first, b.last, b.region.bytes, b.region.host) for b in tl_mod.bands(live, assignment)]
    # b and its loop alias merge into one band; a and c share bytes at different times: two bands
    assert got == [([("a", "{}")], 0, 1, 4000, False), ([("h", "{}")], 1, 2, 16000, True),
                   ([("b", "{}"), ("b_phi", "{1}")], 2, 4, 8000, False), ([("c", "{}")], 5, 6, 4000, False)]
    assert tl_mod.schedule(live) == ["a", "h", "b", "x", "", "c"]


def test_phases_absorb_short_runs():
    labels = ["start"] * 3 + ["forward layers"] * 50 + ["forward"] + ["forward layers"] * 10 + ["loss"] * 20
    assert tl_mod.phases(labels, min_run=3) == [
        {"name": "start", "first": 0, "last": 2}, {"name": "forward layers", "first": 3, "last": 63},
        {"name": "loss", "first": 64, "last": 83}]


def test_a_device_copy_of_a_host_array_is_a_host_copy():
    hlo = hlo_dump.HloModuleText("\n".join([
        "HloModule m", "", "ENTRY %main (p: f32[4,8]) -> f32[4,8] {",
        "  %p = f32[4,8]{1,0:S(5)} parameter(0)",
        "  %cs = (f32[4,8]{1,0:S(5)}, f32[4,8]{1,0}, u32[]) copy-start(%p)",
        "  %cd = f32[4,8]{1,0} copy-done(%cs)",
        "  ROOT %n = f32[4,8]{1,0} negate(%cd)", "}"]))
    assert tl_mod._is_host_transfer(hlo, "cd") and tl_mod._is_host_transfer(hlo, "cs")
    assert not tl_mod._is_host_transfer(hlo, "n") and not tl_mod._is_host_transfer(hlo, "p")


# ------------------------------------------------------------------ the page, the PNG, the browser


def _embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_the_page_is_self_contained_and_carries_the_timeline(run):
    d, tl, _ = run
    page = (d / "t.html").read_text()
    assert not re.search(r"\b(src|href)\s*=", page)  # nothing to fetch: no scripts, styles or images by URL
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)  # the only URL is the SVG namespace
    data = _embedded(page)
    assert data["panels"] == [timeline_html.slim(tl)]
    assert data["panels"][0]["peak"]["device_bytes"] == max(tl["device"]["total"])
    assert data["categories"] == list(tl_mod.CATEGORIES) and data["measured"] is None


def _png_pixels(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def test_the_png_fallback_draws_the_categories(run):
    d, _, _ = run
    img = _png_pixels(d / "t.png")
    rgb = (img[..., :3] * 255).round().astype(int)
    assert img.shape[0] > 200 and img.shape[1] > 500
    for color in ("param", "activation", "logits", "grad"):
        want = [int(timeline_html.COLORS[color][i:i + 2], 16) for i in (1, 3, 5)]
        assert ((abs(rgb - want).sum(axis=-1)) <= 6).sum() > 50, color


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browse(page, tmp_path, width=1400, height=1200):
    """(dumped DOM without its scripts, console lines, screenshot pixels) of `page` in headless Chromium."""
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (Debian: apt-get install chromium)")
    base = [exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr", "--v=0", f"--window-size={width},{height}"]
    url = page.resolve().as_uri()
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = tmp_path / "shot.png"
    subprocess.run(base + [f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    console = [line for line in (dom.stderr + "\n").splitlines() if ":CONSOLE" in line]
    rendered = re.sub(r"<script\b.*?</script>", "", dom.stdout, flags=re.S)  # what the script drew
    return rendered, console, _png_pixels(shot)


def _check_in_browser(page, tmp_path, colors):
    dom, console, img = _browse(page, tmp_path)
    assert console == [], console  # the script logs nothing and throws nothing
    assert 'data-rendered="1"' in dom and '<p class="err">' not in dom
    rgb = (img[..., :3] * 255).round().astype(int)
    assert (rgb.sum(axis=-1) < 700).mean() > 0.05  # not blank: a good part of the window is drawn
    for c in colors:
        want = [int(timeline_html.COLORS[c][i:i + 2], 16) for i in (1, 3, 5)]
        assert ((abs(rgb - want).sum(axis=-1)) <= 6).sum() > 100, c
    return dom


def test_chromium_renders_the_tiny_page(run, tmp_path):
    d, tl, _ = run
    dom = _check_in_browser(d / "t.html", tmp_path, ["param", "activation", "logits", "grad", "optimizer"])
    assert dom.count('class="band"') > 100  # one path per visible buffer
    assert f"live at the device peak ({len(tl['peak']['buffers'])} buffers" in dom
    # hover and click on the biggest band: the tooltip and the pinned box show that buffer
    clicked = tmp_path / "clicked.html"
    clicked.write_text((d / "t.html").read_text().replace("</body>", """<script>
var bands = Array.from(document.querySelectorAll("path.band"));
var big = bands.reduce(function (a, b) { return a.getBBox().height > b.getBBox().height ? a : b; });
big.dispatchEvent(new MouseEvent("mousemove", {clientX: 300, clientY: 300, bubbles: true}));
document.body.setAttribute("data-tip", document.getElementById("tip").style.display);
big.dispatchEvent(new MouseEvent("click", {bubbles: true}));
</script></body>"""))
    dom, console, _ = _browse(clicked, tmp_path / "2")
    assert console == [] and 'data-tip="block"' in dom
    pinned = re.search(r'<div class="pin"><b>pinned buffer</b>(.*?)</div>', dom, re.S).group(1)
    biggest = max(b["bytes"] for b in tl["bands"])  # the [tokens, vocab] fp32 logits and their gradient
    name = re.search(r"<th>buffer</th><td>(.*?)</td>", pinned).group(1)
    assert name in {b["buffer"] for b in tl["bands"] if b["bytes"] == biggest and b["category"] == "logits"}
    assert "kernels.loss=chunked" in pinned and f"({biggest:,})" in pinned and "<th>checkpoint name</th>" in pinned


def test_chromium_renders_the_offloaded_comparison(compared, tmp_path):
    d, _ = compared
    dom = _check_in_browser(d / "c.html", tmp_path, ["param", "optimizer", "host_copy"])
    assert dom.count(">pinned host memory</text>") == 1 and dom.count("live at the device peak") == 2
    assert "same y scale in every panel" in dom


def test_the_measured_page_from_a_metrics_file(tmp_path):
    """Telemetry rows in metrics.jsonl's keys (synthetic here: no GPU on this machine) drawn next to the
    planned peak, the figure labelled with its source."""
    rows = [{"step": s, "loss": 5.0, "mem/bytes_in_use": 6 * 2**30 + s * 2**20,
             "mem/peak_bytes_in_use": 9 * 2**30 + s * 2**22, "plan/device_bytes": 10 * 2**30} for s in range(1, 21)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"step": 21, "loss": 4.9}) + "\n")
    m = timeline_html.measured_from_metrics(metrics, "synthetic rows (test)")
    assert m["planned_device_bytes"] == 10 * 2**30 and len(m["points"]) == 20
    assert m["points"][-1] == {"step": 20, "bytes_in_use": 6 * 2**30 + 20 * 2**20,
                               "peak_bytes_in_use": 9 * 2**30 + 20 * 2**22}
    page = timeline_html.write(tmp_path / "m.html", [], "measured", m)
    assert _embedded(page.read_text())["measured"]["source"] == "synthetic rows (test)"
    dom, console, img = _browse(page, tmp_path)
    assert console == [] and 'data-rendered="1"' in dom
    assert "synthetic rows (test)" in dom and "planned device peak 10.0 GiB (compiled)" in dom
    assert dom.count("<circle") == 40


def test_bench_html_on_cpu_says_there_are_no_allocator_statistics(tmp_path):
    from jaxmem.cli import bench

    assert bench.main(["configs/tiny.yaml", "train.seq_len=32", f"out_dir={tmp_path / 'run'}", "--steps", "2",
                       "--warmup", "1", "--html", str(tmp_path / "b.html"), "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    rows = result["memory_per_step"]
    assert [r["step"] for r in rows["value"]] == [1, 2] and rows["note"] == "not available on cpu"
    data = _embedded((tmp_path / "b.html").read_text())["measured"]
    assert data["points"] == [] and data["planned_device_bytes"] == result["memory"]["planned_device_bytes"]["value"]
    assert data["source"].startswith("measured on CPU")


def test_bad_compare_arguments_fail_before_any_compile(tmp_path):
    from jaxmem.config.schema import ConfigError

    with pytest.raises(ConfigError, match="--compare nope.yaml: config file not found"):
        main(["configs/tiny.yaml", "--compare", "nope.yaml", "--html", str(tmp_path / "x.html")])
    with pytest.raises(ConfigError, match="give --html, --plot or --timeline-json"):
        main(["configs/tiny.yaml", "--compare", "configs/tiny.yaml"])
    with pytest.raises(ConfigError, match="--compare-set"):
        main(["configs/tiny.yaml", "--compare-set", "remat.preset=full", "--html", str(tmp_path / "x.html")])
    assert load_config("configs/tiny.yaml")  # (nothing above compiled)

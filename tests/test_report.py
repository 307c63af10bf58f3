"""`rlcli report`: a real 3-step CPU run rendered to one self-contained HTML page, checked as HTML, as
PNGs, and as a page headless Chromium actually draws (screenshot + DOM)."""

import base64
import io
import json
import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.report.rundata import load_run, read_jsonl

SECTIONS = ["summary", "reward", "length", "health", "time", "throughput", "training", "mismatch", "config",
            "samples"]
PLOT_SECTIONS = ["reward", "length", "health", "time", "throughput", "training", "mismatch"]
NASTY = '<script>alert("x")</script> & <b>bold</b>'
LONG_TAIL = "END-OF-A-VERY-LONG-RESPONSE"


def _train(repo, work, seed):
    out = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
        "trainer.total_train_steps=3", "trainer.train_batch_size=8", "trainer.evaluate_step=1",
        "trainer.checkpoint_interval=2", f"trainer.seed={seed}"])
    assert out.exit_code == 0, out.output
    return work


@pytest.fixture(scope="module")
def run_a(repo, tmp_path_factory):
    return _train(repo, tmp_path_factory.mktemp("report") / "seed-1", 1)


@pytest.fixture(scope="module")
def run_b(repo, tmp_path_factory):
    return _train(repo, tmp_path_factory.mktemp("report") / "seed-2", 2)


def _copy(run, dst):
    """A copy of a work dir without the (large, unused here) model files."""
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("checkpoints", "hf", "model-init", "tensorboard"))
    return dst


@pytest.fixture()
def decorated(run_a, tmp_path):
    """run_a plus one eval sample whose text must be escaped and one whose response must be clipped."""
    work = _copy(run_a, tmp_path / "decorated")
    with (work / "eval" / "step-3.jsonl").open("a") as f:
        base = {"task_name": "arith_eval", "uid": 1, "group_id": 1, "data_source": "nasty-source", "label": "7",
                "reward_details": {"score": 1.0}, "status": "completed", "finish_reason": "stop", "error": None,
                "prompt_tokens": 4, "response_tokens": 1, "staleness": 0}
        f.write(json.dumps({**base, "prompt": NASTY, "response": "7", "reward": 2.0}) + "\n")  # the best
        f.write(json.dumps({**base, "uid": 2, "prompt": "long one", "response": "y" * 2000 + LONG_TAIL,
                            "reward": -1.0}) + "\n")  # the worst
    return work


class _Page(HTMLParser):
    """Sections (id -> their tags and text), every img src and every href/src attribute."""

    def __init__(self):
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current = None
        self.imgs: list[tuple[str | None, str]] = []
        self.links: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "section":
            self.current = a["id"]
            self.sections[self.current] = {"imgs": 0, "text": [], "tags": [], "alts": []}
        if self.current:
            self.sections[self.current]["tags"].append(tag)
        if tag == "img":
            self.imgs.append((self.current, a.get("src", "")))
            if self.current:
                self.sections[self.current]["imgs"] += 1
                self.sections[self.current]["alts"].append(a.get("alt", ""))
        for k in ("href", "src", "action", "poster", "data"):
            if k in a:
                self.links.append(a[k])

    def handle_endtag(self, tag):
        if tag == "section":
            self.current = None

    def handle_data(self, data):
        if self.current:
            self.sections[self.current]["text"].append(data)

    def text(self, sid):
        return " ".join(self.sections[sid]["text"])


def _parse(html):
    p = _Page()
    p.feed(html)
    return p


def _png(uri):
    from PIL import Image

    assert uri.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def _report(*args):
    out = CliRunner().invoke(cli, ["report", *map(str, args)])
    assert out.exit_code == 0, out.output
    return out


def test_report_of_a_3_step_run_is_one_self_contained_page(decorated, tmp_path):
    t0 = time.perf_counter()
    out = _report(decorated, "--out", tmp_path / "r.html")
    elapsed = time.perf_counter() - t0
    assert "wrote" in out.output
    html = (tmp_path / "r.html").read_text()
    page = _parse(html)

    assert list(page.sections) == SECTIONS
    for sid in PLOT_SECTIONS:
        assert page.sections[sid]["imgs"] >= 1, f"section {sid} has no plot: {page.text(sid)[:300]}"
    assert "could not be built" not in html
    # self-contained: no reference leaves the file
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html.lower() and "<link" not in html.lower() and "@import" not in html
    assert all(link.startswith(("#", "data:image/png;base64,")) for link in page.links), page.links
    for _, src in page.imgs:
        img = _png(src)
        assert img.width >= 600 and img.height >= 150
        assert len(np.unique(np.asarray(img).reshape(-1, 3), axis=0)) > 20  # drawn on, not a blank canvas

    # rollouts: real eval samples and training rollouts are there; text is escaped, long text is clipped
    samples = page.text("samples")
    assert "step 3" in samples and "step 0" in samples and "Training rollouts of step 3" in samples
    real = {json.loads(x)["prompt"] for x in (decorated / "eval" / "step-3.jsonl").read_text().splitlines()}
    assert sum(p in samples for p in real) >= 5
    assert "Eval samples: best 5 and worst 5 of 102" in samples
    assert NASTY in samples  # the parser unescapes: the text round-trips ...
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in html  # ... escaped
    assert "<b>bold</b>" not in html
    assert "nasty-source" in samples
    clip = re.search(r"<details class='clip'><summary><span class='pre'>(y+)…</span>", html)
    assert clip and len(clip.group(1)) < 400 and LONG_TAIL in html  # preview + the full text one click away

    # recipe and plugins
    config = page.text("config")
    assert "exact_match" in config and "embedded" in config and "torch" in config
    assert "total_train_steps: 3" in config and "details" in page.sections["config"]["tags"]
    summary = page.text("summary")
    assert "finished" in summary and "decorated" in summary
    assert elapsed < 30, f"report took {elapsed:.1f}s"


def test_default_output_is_in_the_work_dir(decorated):
    out = _report(decorated)
    assert (decorated / "report.html").is_file()
    assert str(decorated / "report.html") in out.output


def _red_pixels(img):
    a = np.asarray(img, dtype=np.int16)
    return int(((a[..., 0] > 180) & (a[..., 1] < 90) & (a[..., 2] < 90)).sum())


def test_two_runs_are_overlaid_with_a_legend(run_a, run_b, tmp_path):
    _report(run_a, run_b, "--out", tmp_path / "both.html")
    html = (tmp_path / "both.html").read_text()
    page = _parse(html)
    assert list(page.sections) == SECTIONS
    summary = page.text("summary")
    assert "seed-1" in summary and "seed-2" in summary
    # one colour per run: the second run's red is in the overlaid reward figure, and not in a single run's
    reward_both = _png(next(s for sec, s in page.imgs if sec == "reward"))
    _report(run_a, "--out", tmp_path / "one.html")
    single = _parse((tmp_path / "one.html").read_text())
    reward_one = _png(next(s for sec, s in single.imgs if sec == "reward"))
    assert _red_pixels(reward_both) > 200 and _red_pixels(reward_one) < 20
    # the step-time split has one panel per run: the overlay's figure is taller
    time_both = _png(next(s for sec, s in page.imgs if sec == "time"))
    time_one = _png(next(s for sec, s in single.imgs if sec == "time"))
    assert time_both.height > 1.6 * time_one.height
    # what differs between the recipes is listed
    config = page.text("config")
    assert "Recipe differences" in config and "trainer.seed" in config
    assert page.text("samples").count("step 3") >= 2


def test_a_run_in_progress_with_missing_files(run_a, tmp_path):
    work = _copy(run_a, tmp_path / "running")
    metrics = work / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text + text.splitlines()[-1][:57])  # the writer is in the middle of a line
    (work / "resolved.yaml").unlink()
    shutil.rmtree(work / "eval")
    _report(work, "--out", tmp_path / "r.html")
    page = _parse((tmp_path / "r.html").read_text())
    assert list(page.sections) == SECTIONS
    assert "partial line" in page.text("summary")
    assert "resolved.yaml is missing" in page.text("config")
    samples = page.text("samples")
    assert "No eval samples" in samples and "Training rollouts of step 3" in samples
    assert page.sections["reward"]["imgs"] == 1  # training reward is still plotted
    assert "No eval metrics yet" not in page.text("reward")  # the eval metrics are in metrics.jsonl

    # a run that has only just started: resolved.yaml and nothing else
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(run_a / "resolved.yaml", fresh / "resolved.yaml")
    _report(fresh, "--out", tmp_path / "fresh.html")
    page = _parse((tmp_path / "fresh.html").read_text())
    for sid in PLOT_SECTIONS:
        assert page.sections[sid]["imgs"] == 0
        assert "metrics.jsonl missing" in page.text(sid), page.text(sid)
    assert "no steps logged yet" in page.text("summary")
    assert "No samples" in page.text("samples") and "exact_match" in page.text("config")


def test_whatever_counters_and_tasks_a_run_logs_are_rendered(run_a, tmp_path):
    """New `rollout/*` counters (say `rollout/aborted_groups`), staleness and multi-task metrics need no report change."""
    work = _copy(run_a, tmp_path / "multi")
    rows, _, _ = read_jsonl(work / "metrics.jsonl")
    with (work / "metrics.jsonl").open("w") as f:
        for r in rows:
            if r["step"] > 0:
                r.update({"rollout/aborted_groups": float(r["step"]), "rollout/staleness_max": 2.0,
                          "rollout/brand_new_counter": 0.0, "task/math/reward_mean": 0.5, "task/code/reward_mean": 0.25})
            if "eval/accuracy" in r:
                r.update({"eval/math/accuracy": 0.5 + r["step"] / 10, "eval/code/accuracy": 0.25 + r["step"] / 10,
                          "eval/flat/accuracy": 0.75})
            f.write(json.dumps(r) + "\n")
    _report(work, "--out", tmp_path / "r.html")
    page = _parse((tmp_path / "r.html").read_text())
    health = page.text("health")
    alts = " ".join(page.sections["health"]["alts"])
    assert "rollout/aborted_groups" in alts and "staleness" in alts
    assert "rollout/expired_groups" not in alts  # zero at every step: listed, not drawn
    zero_line = re.split(r"\scounter\s", health.split("Zero at every step")[1])[0]
    assert "rollout/brand_new_counter" in zero_line and "rollout/aborted_groups" not in zero_line
    assert re.search(r"rollout/aborted_groups\s+6 / 3", health)  # total over steps 1-3, largest in one step
    reward_alts = " ".join(page.sections["reward"]["alts"])
    for title in ("training reward by task", "eval/accuracy", "eval/math/accuracy", "eval/code/accuracy"):
        assert title in reward_alts
    # issue 29: no flat plots (a constant series is named instead), no engine counters among the eval
    # curves, a reward band of one std (not min-max, which fills 0-1 for binary rewards)
    assert "eval/flat/accuracy" not in reward_alts and "eval/engine" not in reward_alts
    assert re.search(r"The same at every step, not drawn:\s+eval/flat/accuracy\s+= 0.75", page.text("reward"))
    assert "training reward (mean; band: ±1 std over samples)" in reward_alts
    assert re.search(r"train/lr\s+= 0.001", page.text("training")) and "learning rate" not in " ".join(
        page.sections["training"]["alts"])


def test_reward_band_and_time_in_steps_of_a_resumed_run(tmp_path):
    """The band is mean ± std within min..max; the time of a run resumed after an hour is its steps' time."""
    from rlcli.report.rundata import load_run
    from rlcli.report.sections import _reward_spread

    rows = [{"step": 0, "time": 100.0, "timing/eval_s": 1.0},
            {"step": 1, "time": 102.0, "timing/step_s": 2.0, "reward/mean": 0.2, "reward/std": 0.4,
             "reward/min": 0.0, "reward/max": 1.0},
            {"step": 2, "time": 3702.0, "timing/step_s": 3.0, "reward/mean": 0.5, "reward/std": 0.1,
             "reward/min": 0.0, "reward/max": 1.0}]  # resumed an hour later
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    assert run.wall_time_s == 6.0
    assert _reward_spread(-1)(run) == ([1, 2], [0.0, 0.4]) and _reward_spread(1)(run) == ([1, 2], [0.6000000000000001, 0.6])


def test_a_section_that_breaks_does_not_cost_the_page(decorated, tmp_path, monkeypatch):
    from rlcli.report import html as report_html

    def boom(runs):
        raise ValueError("odd data")

    boom.__name__ = "section_health"
    monkeypatch.setattr(report_html, "SECTIONS",
                        [boom if f is report_html.section_health else f for f in report_html.SECTIONS])
    _report(decorated, "--out", tmp_path / "r.html")
    page = _parse((tmp_path / "r.html").read_text())
    assert list(page.sections) == SECTIONS
    assert "could not be built: ValueError: odd data" in page.text("health")
    assert page.sections["time"]["imgs"] == 1


def test_not_a_work_dir(tmp_path):
    out = CliRunner().invoke(cli, ["report", str(tmp_path)])
    assert out.exit_code == 2 and "not an rlcli work dir" in out.output
    assert not (tmp_path / "report.html").exists()


def test_readers_tolerate_torn_lines_nonfinite_values_and_repeated_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward/mean": "nan", "train/loss": 2}\n'
                 'garbage\n{"step": 2, "reward/mean": 0.5}\n{"step": 1, "reward/mean": 0.25}\n{"step": 3, "rew')
    rows, bad, torn = read_jsonl(p)
    assert len(rows) == 4 and bad == 2 and torn
    run = load_run(tmp_path)
    assert run.steps == [0, 1, 2]
    assert run.series("reward/mean") == ([1, 2], [0.25, 0.5])  # a repeated step: the later row wins
    assert any("partial line" in n for n in run.notes) and any("1 unreadable" in n for n in run.notes)


def test_a_300_step_run_reports_in_seconds(run_a, tmp_path):
    """Long runs stay fast: 300 steps of real rows, an eval every 25 steps, rollouts every step."""
    work = tmp_path / "long"
    (work / "eval").mkdir(parents=True)
    (work / "rollouts").mkdir()
    shutil.copy(run_a / "resolved.yaml", work / "resolved.yaml")
    rows, _, _ = read_jsonl(run_a / "metrics.jsonl")
    train_row = rows[-2]
    eval_keys = {k: v for k, v in rows[0].items() if k.startswith("eval/")}
    eval_file = (run_a / "eval" / "step-3.jsonl").read_text()
    roll_file = (run_a / "rollouts" / "step-3.jsonl").read_text()
    with (work / "metrics.jsonl").open("w") as f:
        for s in range(0, 301):
            row = {**train_row, "step": s, "reward/mean": s / 300, "time": 1000.0 + s, "train/loss": s / 1000}
            if s % 25 == 0:
                row.update(eval_keys, **{"eval/accuracy": s / 300})  # a constant series is not drawn
                (work / "eval" / f"step-{s}.jsonl").write_text(eval_file)
            if s:
                (work / "rollouts" / f"step-{s}.jsonl").write_text(roll_file)
            f.write(json.dumps(row) + "\n")
    t0 = time.perf_counter()
    _report(work, "--out", tmp_path / "long.html")
    elapsed = time.perf_counter() - t0
    page = _parse((tmp_path / "long.html").read_text())
    assert all(page.sections[s]["imgs"] >= 1 for s in PLOT_SECTIONS)
    assert "12 of 13 eval steps shown" in page.text("samples")
    assert elapsed < 20, f"300-step report took {elapsed:.1f}s"


# ------------------------------------------------------------------ rendered by a real browser
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def _find_chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def chromium():
    """Debian's ``chromium``; installed with apt-get when missing and we are root, else the test is skipped."""
    path = _find_chromium()
    if path:
        return path
    why = "headless Chromium is not installed"
    if not shutil.which("apt-get"):
        pytest.skip(f"{why} and there is no apt-get to install it (install the 'chromium' package)")
    if os.geteuid() != 0:
        pytest.skip(f"{why} and installing it needs root (run: apt-get install -y chromium)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log = ""
    for cmd in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "chromium"]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log = str(exc)
            break
        log = (r.stdout + r.stderr)[-800:]
        if cmd[1] == "install" and r.returncode == 0:
            break
    path = _find_chromium()
    if not path:
        last = (log.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"{why} and `apt-get install -y chromium` failed: {last}")
    return path


def _chromium(chromium, tmp_path, url, *args):
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _screenshot(chromium, tmp_path, html_path, name):
    from PIL import Image

    png = tmp_path / f"{name}.png"
    _chromium(chromium, tmp_path, html_path.as_uri(), f"--screenshot={png}", "--window-size=1280,4000")
    assert png.is_file(), f"chromium wrote no screenshot {png}"
    return Image.open(png).convert("RGB")


def _row_bands(rows_with_pixels, min_gap=12):
    """Maximal runs of screenshot rows (allowing gaps < min_gap) -> [(top, bottom)]."""
    bands = []
    for y in rows_with_pixels:
        if bands and y - bands[-1][1] < min_gap:
            bands[-1][1] = y
        else:
            bands.append([y, y])
    return [tuple(b) for b in bands]


def test_screenshot_shows_the_plots_and_the_dom_has_the_rollouts(chromium, decorated, tmp_path):
    """The browser draws the page: screenshot it with and without the plots (hidden, same layout); the
    pixels that differ are exactly where the plots are, and they must hold drawn figures, not blank boxes."""
    _report(decorated, "--out", tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    hidden = tmp_path / "hidden.html"
    hidden.write_text(html.replace("</head>", "<style>img.plot { visibility: hidden !important; }</style></head>", 1))

    shot = np.asarray(_screenshot(chromium, tmp_path, tmp_path / "r.html", "report"), dtype=np.int16)
    blank = np.asarray(_screenshot(chromium, tmp_path, hidden, "hidden"), dtype=np.int16)
    assert shot.shape == blank.shape == (4000, 1280, 3)

    # the page itself rendered: dark text pixels in the header
    assert (shot[:60].min(axis=2) < 100).sum() > 200

    diff = np.abs(shot - blank).max(axis=2) > 8
    ys = np.nonzero(diff.any(axis=1))[0]
    bands = [b for b in _row_bands(list(ys)) if b[1] - b[0] >= 100]
    # within 4000 px: reward/eval, response length, staleness, step time, throughput (and more)
    assert len(bands) >= 4, f"plot regions found: {bands}"
    for top, bottom in bands:
        cols = np.nonzero(diff[top:bottom + 1].any(axis=0))[0]
        assert cols.max() - cols.min() > 500, (top, bottom, cols.min(), cols.max())
        region = shot[top:bottom + 1, cols.min():cols.max() + 1]
        empty = blank[top:bottom + 1, cols.min():cols.max() + 1]
        non_white = (region.min(axis=2) < 235).mean()
        coloured = ((region.max(axis=2) - region.min(axis=2)) > 60).mean()
        # axes, ticks, labels and curves: ink on a white page, well above the same box without the plot
        assert 0.02 < non_white < 0.9, f"rows {top}-{bottom}: {non_white:.3f} non-white"
        assert (empty.min(axis=2) < 235).mean() < non_white / 3
        assert coloured > 0.003, f"rows {top}-{bottom}: no coloured curves/bars ({coloured:.4f})"
        assert region.std() > 15
    assert sum(b - t for t, b in bands) > 1200  # the figures fill a good part of the first 4000 px

    dom = _chromium(chromium, tmp_path, (tmp_path / "r.html").as_uri(), "--dump-dom")
    assert dom.count('class="plot"') == html.count("class=\"plot\"") >= len(PLOT_SECTIONS)
    assert "Sample rollouts" in dom and "Training rollouts of step 3" in dom and "nasty-source" in dom
    assert "&lt;script&gt;alert" in dom and "<script>alert" not in dom  # text, not an element
    assert "Eval samples: best 5 and worst 5 of 102" in dom


def test_inspect_reads_what_the_trainer_dumped(run_a):
    """The real dump format: `inspect --json` round-trips rows of a real run."""
    out = CliRunner().invoke(cli, ["inspect", str(run_a), "--step", "2", "--min-reward", "1", "--json"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    want = [r for r in (json.loads(x) for x in (run_a / "rollouts" / "step-2.jsonl").read_text().splitlines())
            if r["reward"] >= 1]
    assert rows == want
    resolved = yaml.safe_load((run_a / "resolved.yaml").read_text())
    assert resolved["recipe"]["trainer"]["total_train_steps"] == 3


def test_report_module_does_not_touch_pyplot(decorated, tmp_path):
    import sys

    _report(decorated, "--out", tmp_path / "r.html")
    plt = sys.modules.get("matplotlib.pyplot")
    assert plt is None or not plt.get_fignums()
    assert Path(tmp_path / "r.html").stat().st_size > 10_000

"""A resumed offline W&B run: the warning at resume, and ``fl_lightning.tools.wandb_sync`` uploading it as one run.

The upload itself is checked with the installed ``wandb sync`` against a small recording fake of the W&B backend
(GraphQL and file stream on 127.0.0.1), since no test reaches W&B's servers.
"""

import gzip
import json
import shutil
import stat
import subprocess
import sys
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from fl_lightning.cli import main
from fl_lightning.outputs.tracking import WandbOfflineResumeWarning
from fl_lightning.tools import wandb_sync
from tests.test_configs import TINY
from tests.wandb_offline import history_and_config, read_records

CONFIG = "configs/fedavg_digits.yaml"
ARGS = [
    "--config", CONFIG,
    *[a for a in TINY if not a.startswith("--trainer.logger")],  # the CLI's default logger: W&B offline
    "--federation.run_name=r",
    "--federation.keep_checkpoints=0",
    "--federation.plots=false",
    "--federation.checkpoint_every=2",
]  # fmt: skip
OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def rounds_of(file: Path) -> list[int]:
    return [r for r in map(wandb_sync.history_round, read_records(file)) if r is not None]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run killed after round 3 but before its checkpoint (deleted here), resumed from round 2 to round 4."""
    out = tmp_path_factory.mktemp("resumed")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        main([*ARGS, f"--federation.output_dir={out}", "--federation.rounds=3"])
        (out / "r/checkpoints/round-00003.ckpt").unlink()
        with pytest.warns(WandbOfflineResumeWarning) as warned:
            main([*ARGS, f"--federation.output_dir={out}", "--federation.rounds=4", "--federation.resume=last"])
    return out / "r", [str(w.message) for w in warned if w.category is WandbOfflineResumeWarning]


@pytest.fixture
def run_dir(resumed, tmp_path):
    """A copy of the resumed run for one test (syncing leaves markers and copies in it)."""
    return Path(shutil.copytree(resumed[0], tmp_path / "r", symlinks=True))


def test_resuming_offline_says_how_to_upload_and_the_helper_plans_the_parts_in_order(resumed, run_dir, capsys):
    # W&B wrote a second offline directory with the same id...
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1
    # ... and the terminal said, once, what to run
    (message,) = resumed[1]
    run_id = files[0].name.removeprefix("run-").removesuffix(".wandb")
    assert f"python -m fl_lightning.tools.wandb_sync {resumed[0]}" in message and run_id in message
    recorded = json.loads((run_dir / wandb_sync.RECORD).read_text())
    assert [run_dir / p["file"] for p in recorded] == files and {p["run_id"] for p in recorded} == {run_id}

    parts, notes = wandb_sync.find_parts(run_dir)
    assert [p.file for p in parts] == files and notes == []  # oldest first: the order W&B resumes in
    assert [p.resume for p in parts] == [False, True]
    assert parts[0].rounds == [1, 2, 3] and parts[1].rounds == [3, 4]  # round 3 ran again after the resume

    assert wandb_sync.main([str(run_dir), "--dry-run", "--wandb", "wandb"]) == 0
    out = capsys.readouterr().out
    trimmed = parts[0].trimmed_file.parent
    assert out.count("would run: ") == 2
    assert out.index(f"would run: wandb sync {trimmed}") < out.index(f"would run: wandb sync {parts[1].dir}")
    assert "rounds [3] are run again" in out
    assert not trimmed.exists()  # a dry run writes nothing


def test_the_helper_syncs_each_part_in_order_without_repeated_rounds(run_dir, tmp_path):
    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "fake-wandb"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    parts, _ = wandb_sync.find_parts(run_dir)

    assert wandb_sync.main([str(run_dir), "--wandb", str(fake), "--", "-p", "proj"]) == 0
    trimmed = parts[0].trimmed_file
    argv = [json.loads(line) for line in calls.read_text().splitlines()]
    assert argv == [["sync", "-p", "proj", str(trimmed.parent)], ["sync", "-p", "proj", str(parts[1].dir)]]
    assert rounds_of(trimmed) == [1, 2] and rounds_of(parts[0].file) == [1, 2, 3]  # the original is untouched
    assert (trimmed.parent / "files").is_dir()  # W&B uploads the run's files from there
    # everything but the repeated round's row is kept, byte for byte
    kept = [p for p in wandb_sync.read_payloads(parts[0].file) if wandb_sync._round_of(p) != 3]
    assert list(wandb_sync.read_payloads(trimmed)) == kept

    # once wandb sync marked a part uploaded, it is not uploaded again
    (trimmed.parent / (trimmed.name + ".synced")).touch()
    calls.unlink()
    assert wandb_sync.main([str(run_dir), "--wandb", str(fake)]) == 0
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [["sync", str(parts[1].dir)]]


# ------------------------------------------------------------------------------------------------ real wandb sync


class FakeBackend(BaseHTTPRequestHandler):
    """The GraphQL and file-stream calls ``wandb sync`` makes, answered like W&B and kept in ``runs``."""

    runs: dict[str, dict] = {}

    def log_message(self, *args):
        pass

    def _reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return gzip.decompress(data) if self.headers.get("Content-Encoding") == "gzip" else data

    def do_PUT(self):  # uploads of the run's files
        self._body()
        self._reply({})

    def do_POST(self):
        req = json.loads(self._body() or b"{}")
        if "file_stream" in self.path:
            run = self.runs.setdefault(self.path.split("/")[4], {"history": [], "summary": "{}"})
            for name, chunk in (req.get("files") or {}).items():
                if name == "wandb-history.jsonl":  # lines written at the given offset, as W&B's server does
                    run["history"][chunk["offset"] : chunk["offset"] + len(chunk["content"])] = chunk["content"]
                elif name == "wandb-summary.json":
                    run["summary"] = chunk["content"][-1]
            return self._reply({"exitcode": None, "limits": {}})
        op, v = req.get("query", "").split("(")[0].split("{")[0].split()[-1], req.get("variables") or {}
        run = self.runs.get(v.get("name") or "")
        project = {"id": "p", "name": v.get("project") or "p", "entity": {"id": "e", "name": "me"}}
        if op == "Viewer":
            viewer = {"id": "u", "entity": "me", "username": "me", "flags": "{}", "teams": {"edges": []}}
            return self._reply({"data": {"viewer": viewer}})
        if op == "UpsertBucket":
            run = self.runs.setdefault(v["name"], {"history": [], "summary": "{}"})
            bucket = {"id": v["name"], "name": v["name"], "config": "{}", "project": project}
            bucket["historyLineCount"] = len(run["history"])  # where wandb-core appends a part's rows
            return self._reply({"data": {"upsertBucket": {"bucket": bucket}}})
        if op == "RunResumeStatus":
            bucket = run and {
                "id": v["name"], "name": v["name"], "summaryMetrics": run["summary"], "historyLineCount":
                len(run["history"]), "historyTail": json.dumps(run["history"][-10:]), "eventsTail": "[]",
                "logLineCount": 0, "eventsLineCount": 0, "config": "{}", "tags": [], "wandbConfig": '{"t": {}}',
            }  # fmt: skip
            return self._reply({"data": {"model": {**project, "bucket": bucket}}})
        if op == "CreateRunFiles":
            url = f"http://127.0.0.1:{self.server.server_address[1]}/upload"
            files = [{"name": f, "uploadUrl": f"{url}/{f}"} for f in v["files"]]
            return self._reply({"data": {"createRunFiles": {"runID": "b", "uploadHeaders": [], "files": files}}})
        return self._reply({"data": {"serverInfo": {"features": []}} if op == "ServerFeaturesQuery" else {}})


@pytest.fixture
def backend(tmp_path, monkeypatch):
    FakeBackend.runs = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeBackend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("HOME", str(tmp_path))  # no netrc or settings of the user's
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    yield FakeBackend.runs
    server.shutdown()


def history(runs):
    (run,) = runs.values()
    return [json.loads(line) for line in run["history"]]


def test_wandb_sync_of_the_planned_parts_makes_one_history(run_dir, backend):
    assert wandb_sync.main([str(run_dir)]) == 0
    rows = history(backend)
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and [r["_step"] for r in rows] == [0, 1, 2, 3]
    # round 3 is the resumed run's, the one rounds.csv kept
    rounds_csv = (run_dir / "rounds.csv").read_text().splitlines()
    header, row3 = rounds_csv[0].split(","), rounds_csv[3].split(",")
    assert float(row3[header.index("time/round")]) == rows[2]["time/round"]


def test_wandb_sync_itself_orders_the_parts_but_keeps_repeated_rounds(run_dir, backend):
    """What W&B does with both directories (why the helper trims): in order, steps reassigned, round 3 twice."""
    subprocess.run([*wandb_sync.default_wandb(), "sync", str(run_dir / "wandb")], check=True)
    rows = history(backend)
    assert [r["round"] for r in rows] == [1, 2, 3, 3, 4] and [r["_step"] for r in rows] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------ a killed run's hole


def _cut_before_round(file: Path, round_idx: int) -> None:
    """Cut ``file`` as a SIGKILL does: mid-record, inside the history row of ``round_idx`` (nothing after it)."""
    payloads = list(wandb_sync.read_payloads(file))
    keep = next(i for i, p in enumerate(payloads) if wandb_sync._round_of(p) == round_idx)
    prefix = file.with_suffix(".prefix")
    wandb_sync.write_payloads(prefix, payloads[:keep])
    cut = len(prefix.read_bytes()) + 20  # the same LevelDB-log chunking: a prefix of the file, plus 20 bytes
    prefix.unlink()
    file.write_bytes(file.read_bytes()[:cut])


def _killed_after_round_3(out: Path, journal: bool) -> tuple[Path, list[dict]]:
    """Three rounds, checkpoint 3 written, W&B's file cut inside round 3; then resumed to round 4."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        main([*ARGS, f"--federation.output_dir={out}", "--federation.rounds=3"])
        (first,) = (out / "r").glob("wandb/offline-run-*/run-*.wandb")
        logged = [h for h in history_and_config(first)[0] if "round" in h]
        _cut_before_round(first, 3)
        assert rounds_of(first) == [1, 2]
        if not journal:  # a run started before the record existed
            (out / "r" / "tracked_rounds.jsonl").unlink()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            main([*ARGS, f"--federation.output_dir={out}", "--federation.rounds=4", "--federation.resume=last"])
    return out / "r", [logged, [str(w.message) for w in warned]]


def test_a_round_lost_by_a_kill_is_logged_again_at_the_resume_and_the_upload_has_every_round(tmp_path, backend):
    """Failed before: part 1 held rounds 1-2, part 2 round 4; the plan and the upload said nothing of round 3."""
    run_dir, (logged, _) = _killed_after_round_3(tmp_path / "out", journal=True)
    parts, _ = wandb_sync.find_parts(run_dir)
    assert [p.rounds for p in parts] == [[1, 2], [3, 4]]
    # round 3 again, exactly as it was logged the first time (W&B's own keys aside)
    again = [h for h in history_and_config(parts[1].file)[0] if "round" in h][0]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("_")}  # noqa: E731
    assert strip(again) == strip(logged[2]) and json.loads(again["round"]) == 3

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", out := __import__("io").StringIO())
        assert wandb_sync.main([str(run_dir), "--dry-run", "--wandb", "wandb"]) == 0
    assert "history after the upload: rounds 1-4, each once, as in rounds.csv" in out.getvalue()
    assert "warning" not in out.getvalue()
    assert wandb_sync.main([str(run_dir)]) == 0
    assert [r["round"] for r in history(backend)] == [1, 2, 3, 4]


def test_the_dry_run_reports_a_round_no_part_holds_and_the_resume_warns(tmp_path, capsys):
    run_dir, (_, warned) = _killed_after_round_3(tmp_path / "out", journal=False)
    assert any("rounds [3] are done (rounds.csv) but in no offline W&B part" in w for w in warned)
    capsys.readouterr()
    assert wandb_sync.main([str(run_dir), "--dry-run", "--wandb", "wandb"]) == 0
    out = capsys.readouterr().out
    assert "warning: rounds [3] are in rounds.csv but in no W&B part" in out and "history after" not in out


def test_the_report_names_rounds_twice_and_rounds_rounds_csv_lacks(tmp_path):
    wandb_dir = tmp_path / "r" / "wandb"
    write_part(wandb_dir, "1", "abc", 10, False, rounds=[1, 2, 2, 3])  # round 2 twice in a row: one round
    write_part(wandb_dir, "2", "abc", 20, True, rounds=[3, 4, 5])
    (tmp_path / "r" / "rounds.csv").write_text("round,x\n1,0\n2,0\n3,0\n4,0\n")
    parts, _ = wandb_sync.find_parts(tmp_path / "r")
    uploads = wandb_sync.plan(parts)
    assert wandb_sync.history_problems(uploads, [1, 2, 3, 4]) == [
        "rounds [5] are in W&B but not in rounds.csv (logged after the last checkpoint of a run that was killed and "
        "not resumed): resume it to run them again"
    ]
    (uploads[0].part.file.with_name(uploads[0].part.file.name + ".synced")).touch()  # uploaded whole, before
    problems = wandb_sync.history_problems(wandb_sync.plan(parts), [1, 2, 3, 4, 5])
    assert len(problems) == 1 and problems[0].startswith("rounds [3] appear more than once")
    assert wandb_sync.history_problems(wandb_sync.plan(parts[:1]), [1, 2, 3, 4]) == [
        "rounds [4] are in rounds.csv but in no W&B part (lost when the run was killed): resuming the run with this "
        "version logs them again from tracked_rounds.jsonl before its next round; a run started before that record "
        "existed cannot get them back"
    ]


# ------------------------------------------------------------------------------------------------ refusals


def write_part(wandb_dir: Path, name: str, run_id: str, start: int, resume: bool, rounds=(), project="p") -> Path:
    """A hand-made offline part: a run record, one history row per round, then more records."""
    records = [pb.Record(run=pb.RunRecord(run_id=run_id, project=project, resume=resume))]
    records[0].run.start_time.FromSeconds(start)
    for r in rounds:
        records.append(pb.Record(history=pb.HistoryRecord(item=[pb.HistoryItem(key="round", value_json=str(r))])))
    records.append(pb.Record(output_raw=pb.OutputRawRecord(line="x" * 70000)))  # spans three 32 KiB blocks
    file = wandb_dir / f"offline-run-{name}-{run_id}" / f"run-{run_id}.wandb"
    file.parent.mkdir(parents=True)
    wandb_sync.write_payloads(file, [r.SerializeToString() for r in records])
    return file


def test_the_transaction_log_reads_back_and_a_killed_part_loses_only_its_last_record(tmp_path):
    file = write_part(tmp_path, "1", "abc", 10, False, rounds=[1, 2])
    assert [r.WhichOneof("record_type") for r in read_records(file)] == ["run", "history", "history", "output_raw"]
    assert read_records(file)[3].output_raw.line == "x" * 70000
    file.write_bytes(file.read_bytes()[:-100])  # killed while writing
    part = wandb_sync.load_part(file)
    assert part.rounds == [1, 2] and len(list(wandb_sync.read_payloads(file))) == 3


def test_refuses_parts_of_other_runs_missing_parts_and_parts_not_recorded_as_resumed(tmp_path, capsys):
    wandb_dir = tmp_path / "r" / "wandb"
    first = write_part(wandb_dir, "1", "abc", 10, False, rounds=[1, 2])
    other = write_part(wandb_dir, "2", "xyz", 20, True, rounds=[3])
    assert wandb_sync.main([str(tmp_path / "r"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "different W&B runs" in err and str(first.parent) in err and str(other.parent) in err

    shutil.rmtree(other.parent)
    later = write_part(wandb_dir, "3", "abc", 30, False, rounds=[3])  # e.g. written by a wandb without `resume`
    assert wandb_sync.main([str(tmp_path / "r"), "--dry-run"]) == 2
    assert f"{later.parent} continues W&B run abc but its run record does not ask" in capsys.readouterr().err

    shutil.rmtree(later.parent)
    for file in (first, write_part(wandb_dir, "4", "abc", 40, True, rounds=[3])):
        wandb_sync.record_part(tmp_path / "r", file, "abc")
    shutil.rmtree(first.parent)
    assert wandb_sync.main([str(tmp_path / "r"), "--dry-run"]) == 2
    assert f"part {first.relative_to(tmp_path / 'r')} of W&B run abc" in capsys.readouterr().err

"""A malformed or hostile run fails alone (issue 13): symlinks leading outside the served folder,
wrong types in meta.json and in stored documents; the CLI answers one line, the dashboard 4xx."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fixtures.runs import write_small_run
from torchdebug.store import list_runs

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from torchdebug.views.server import create_app  # noqa: E402

# -- item 9: symlinks ---------------------------------------------------------------------------------


def test_links_leading_outside_the_served_folder_are_neither_listed_nor_served(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    secret_run = write_small_run(outside, name="secret")
    (outside / "secret.json").write_text(json.dumps({"name": "SECRET", "created": "2026-01-01T00:00:00"}))
    served = tmp_path / "served"
    good = write_small_run(served, name="good")
    # A run folder whose meta.json is a link to a file outside.
    leak = served / "leak"
    shutil.copytree(good, leak)
    (leak / "meta.json").unlink()
    (leak / "meta.json").symlink_to(outside / "secret.json")
    # A run folder whose database links outside.
    db_leak = served / "dbleak"
    shutil.copytree(good, db_leak)
    (db_leak / "rank0.sqlite").unlink()
    (db_leak / "rank0.sqlite").symlink_to(secret_run / "rank0.sqlite")
    # A run folder that is itself a link to a run outside.
    (served / "linked").symlink_to(secret_run, target_is_directory=True)

    infos = {i.path.name: i for i in list_runs(served)}
    assert sorted(infos) == ["dbleak", good.name, "leak"]  # "linked" is not listed
    assert infos[good.name].status == "finished"
    assert infos["leak"].status == "unreadable" and infos["leak"].error == (
        f"{leak / 'meta.json'} links outside its run folder; refused"
    )
    assert infos["dbleak"].status == "unreadable" and "rank0.sqlite links outside" in (
        infos["dbleak"].error or ""
    )
    assert infos["leak"].name == "leak"  # the outside file's "SECRET" name was never read

    with TestClient(create_app(served, warm=0), base_url="http://127.0.0.1") as client:
        listed = client.get("/api/runs").json()["runs"]
        assert sorted(r["id"] for r in listed) == ["dbleak", good.name, "leak"]
        assert "SECRET" not in client.get("/api/runs").text and "SECRET" not in client.get("/").text
        for rid in ("leak", "dbleak", "linked"):
            for url in (
                f"/api/runs/{rid}",
                f"/runs/{rid}",
                f"/api/runs/{rid}/metrics",
                f"/api/runs/{rid}/report.json",
                f"/training-logs/debug/summary?run={rid}",
            ):
                r = client.get(url)
                assert r.status_code == 404, (url, r.text)
                assert "no run" in r.json()["error"] and "SECRET" not in r.text
        assert client.get(f"/api/runs/{good.name}").status_code == 200


# -- item 7: a malformed run fails alone ----------------------------------------------------------------

_DEEP = "[" * 200_000 + "]" * 200_000


def _set_meta(run: Path, key: str, value: object) -> None:
    meta = json.loads((run / "meta.json").read_text())
    meta[key] = value
    (run / "meta.json").write_text(json.dumps(meta))


def _sql(run: Path, statement: str, *params: object) -> None:
    import sqlite3

    conn = sqlite3.connect(run / "rank0.sqlite", isolation_level=None)
    conn.execute(statement, params)
    conn.close()


# (damage, where the run breaks, the reason it gives)
_DAMAGE = {
    "created_int": (
        lambda r: _set_meta(r, "created", 20260101),
        "meta",
        "'created' must be a string or null, found int 20260101",
    ),
    "config_string": (
        lambda r: _set_meta(r, "config", "lr=1"),
        "meta",
        "'config' must be a JSON object or null, found str 'lr=1'",
    ),
    "config_list": (
        lambda r: _set_meta(r, "config", [1, 2]),
        "meta",
        "'config' must be a JSON object or null, found a JSON list",
    ),
    "meta_list": (
        lambda r: (r / "meta.json").write_text("[1, 2]"),
        "meta",
        "must hold a JSON object, found a JSON list",
    ),
    "meta_deep": (
        lambda r: (r / "meta.json").write_text('{"config": ' + _DEEP + "}"),
        "meta",
        "nested too deeply",
    ),
    "anomaly_list": (
        lambda r: _sql(r, "UPDATE anomalies SET data = '[1, 2]'"),
        "db",
        "anomalies row 1 must hold a JSON object, found a JSON list",
    ),
    "anomaly_deep": (
        lambda r: _sql(r, "UPDATE anomalies SET data = ?", _DEEP),
        "db",
        "anomalies row 1 is JSON nested too deeply",
    ),
    "frames_text": (
        lambda r: _sql(r, """UPDATE anomalies SET data = '{"frames": "abc"}'"""),
        "db",
        "'frames' must be a JSON list or null",
    ),
    "metric_text": (
        lambda r: _sql(r, "UPDATE scalars SET value = 'abc' WHERE step = 3"),
        "db",
        "holds str 'abc' where a number belongs",
    ),
    "memory_text": (
        lambda r: _sql(r, "UPDATE memory SET value = 'abc' WHERE key = 'rss' AND step = 3"),
        "db",
        "memory 'rss' holds str 'abc' where a number belongs (step 3)",
    ),
    "memory_blob": (
        lambda r: _sql(r, "UPDATE memory SET value = x'0102' WHERE key = 'rss' AND step = 3"),
        "db",
        "memory 'rss' holds bytes b'\\x01\\x02' where a number belongs (step 3)",
    ),
    "rollup_text": (
        lambda r: _sql(r, "UPDATE metric_rollup SET sum = 'abc' WHERE metric_id = 1"),
        "db",
        "metric_rollup of 'loss' holds str 'abc' where a number belongs (its bucket of steps 0-4095)",
    ),
    "timing_rollup_text": (
        lambda r: _sql(r, "UPDATE timing_rollup SET sum = 'zz' WHERE phase = 'forward'"),
        "db",
        "timing_rollup of 'forward' holds str 'zz' where a number belongs (its bucket of steps 0-4095)",
    ),
    "event_data_list": (
        lambda r: _sql(r, "UPDATE events SET data = '[1]'"),
        "db",
        "events row 1 must hold a JSON object",
    ),
    "stats_text": (
        lambda r: _sql(r, "UPDATE tensor_stats SET data = '\"x\"'"),
        "db",
        "tensor_stats at step 0 'fc1.weight.grad' must hold a JSON object",
    ),
}

_ROUTES = (
    "/",
    "/api/runs",
    "/api/runs/{id}",
    "/runs/{id}",
    "/api/runs/{id}/metrics",
    "/api/runs/{id}/anomalies",
    "/api/runs/{id}/events",
    "/api/runs/{id}/report.json",
    "/api/runs/{id}/views",
    "/training-logs/debug/summary",
    "/training-logs/debug/summary?run={id}",
    "/training-logs/debug/training/summary?run={id}",
)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_run(tmp_path_factory.mktemp("template"), name="good")


def _served(tmp_path: Path, template: Path) -> tuple[Path, Path, Path]:
    served = tmp_path / "served"
    served.mkdir()
    good = served / "good"
    bad = served / "bad"
    shutil.copytree(template, good)
    shutil.copytree(template, bad)
    _set_meta(bad, "created", "2099-01-01T00:00:00")  # the newest: the default run of the seed routes
    return served, good, bad


def _cli(*args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from torchdebug.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _no_500(client: TestClient, run_id: str) -> dict[str, int]:
    codes = {}
    for route in _ROUTES:
        url = route.format(id=run_id)
        r = client.get(url)
        assert r.status_code < 500, (url, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"], url
        codes[url] = r.status_code
    return codes


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_malformed_run_fails_alone(tmp_path: Path, template: Path, damage: str) -> None:
    served, _, bad = _served(tmp_path, template)
    hurt, where, reason = _DAMAGE[damage]
    hurt(bad)

    infos = {i.path.name: i for i in list_runs(served)}
    assert infos["good"].status == "finished"
    if where == "meta":
        assert infos["bad"].status == "unreadable" and reason in (infos["bad"].error or "")

    code, out, err = _cli("runs", str(served))
    assert code == 0 and "good" in out and "Traceback" not in err
    if where == "meta":
        assert "unreadable" in out and reason in out
    for cmd in ("show", "report"):
        code, out, err = _cli(cmd, str(bad))
        # show reads the anomalies and, for its verdict line, the events
        reads = {"show": ("anomaly_list", "anomaly_deep", "frames_text", "event_data_list")}.get(
            cmd, tuple(set(_DAMAGE) - {"stats_text"})
        )
        if where == "meta" or damage in reads:
            assert code == 1, (cmd, out)
            assert err.count("\n") == 1 and reason in err and "internal error" not in err, err
        else:  # show reads no tensor stats nor the value at step 3; the text report no stats
            assert code == 0, err

    with TestClient(create_app(served, warm=0), base_url="http://127.0.0.1") as client:
        codes = _no_500(client, "bad")
        broken = "/api/runs/bad/views" if damage == "stats_text" else "/api/runs/bad/report.json"
        assert codes["/api/runs"] == 200 and codes[broken] == 422
        assert reason in client.get(broken).json()["error"]
        assert client.get("/api/runs/good/report.json").status_code == 200


def test_a_step_past_sqlite_integers_is_an_empty_answer(tmp_path: Path, template: Path) -> None:
    served, _, _ = _served(tmp_path, template)
    with TestClient(create_app(served, warm=0), base_url="http://127.0.0.1") as client:
        r = client.get("/api/runs/good/metrics?names=loss&since_step=9223372036854775807")
        assert r.status_code == 200 and r.json()["metrics"]["loss"]["steps"] == []
        r = client.get("/api/runs/good/metrics?names=loss&since_step=99999999999999999999999")
        assert r.status_code in (200, 422)


# -- fuzz: random types, deletions and deep nesting in meta.json and the stored documents -----------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _text
_json = st.recursive(
    _leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=8
)
_META_KEYS = [
    "run_id",
    "name",
    "created",
    "status",
    "ended",
    "host",
    "pid",
    "config",
    "rank",
    "world_size",
    "schema_version",
    "opened",
    "dropped",
    "lost",
    "lost_from_step",
    "write_error",
]
_ANOMALY_KEYS = [
    "frames",
    "tensor",
    "stack",
    "related",
    "summary",
    "kind",
    "phase",
    "module",
    "micro_step",
    "hint",
]
_deep = st.integers(2, 3000).map(lambda n: "[" * n + "]" * n)
_mutation = st.one_of(
    st.tuples(st.just("meta_set"), st.sampled_from(_META_KEYS), _json),
    st.tuples(st.just("meta_del"), st.sampled_from(_META_KEYS), st.none()),
    st.tuples(st.just("meta_whole"), st.none(), _json.map(json.dumps) | _deep | _text),
    st.tuples(
        st.just("doc"),
        st.sampled_from(["anomalies", "events", "tensor_stats"]),
        _json.map(json.dumps) | _deep,
    ),
    st.tuples(st.just("anomaly_field"), st.sampled_from(_ANOMALY_KEYS), _json),
    st.tuples(st.just("event_field"), st.sampled_from(["modules", "evidence"]), _json),
    st.tuples(
        st.just("value"), st.sampled_from(["scalars", "memory", "timings"]), _text | st.binary(max_size=8)
    ),
)


def _mutate(run: Path, how: str, key: object, value: object) -> None:
    meta = run / "meta.json"
    if how in ("meta_set", "meta_del"):
        doc = json.loads(meta.read_text())
        if isinstance(doc, dict):  # an earlier mutation may have replaced the whole object
            if how == "meta_set":
                doc[str(key)] = value
            else:
                doc.pop(str(key), None)
            meta.write_text(json.dumps(doc))
    elif how == "meta_whole":
        meta.write_text(str(value))
    elif how == "doc":
        _sql(run, f"UPDATE {key} SET data = ? WHERE rowid = (SELECT min(rowid) FROM {key})", value)
    elif how in ("anomaly_field", "event_field"):
        import sqlite3

        table = "anomalies" if how == "anomaly_field" else "events"
        conn = sqlite3.connect(run / "rank0.sqlite", isolation_level=None)
        rowid, text = conn.execute(f"SELECT rowid, data FROM {table} ORDER BY rowid LIMIT 1").fetchone()
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict):  # an earlier mutation may have replaced the whole document
            doc[str(key)] = value
            conn.execute(f"UPDATE {table} SET data = ? WHERE rowid = ?", (json.dumps(doc), rowid))
        conn.close()
    else:
        column = {"scalars": "value", "memory": "value", "timings": "seconds"}[str(key)]
        _sql(run, f"UPDATE {key} SET {column} = ? WHERE rowid = (SELECT max(rowid) FROM {key})", value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=3))
def test_fuzzed_runs_never_give_a_500_or_a_traceback(tmp_path: Path, template: Path, mutations: list) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        served, _, bad = _served(Path(scratch), template)
        for how, key, value in mutations:
            try:
                _mutate(bad, how, key, value)
            except (json.JSONDecodeError, RecursionError):
                pass  # meta.json already replaced by non-JSON or deep JSON: nothing left to edit
        for cmd in (
            ("runs", str(served)),
            ("show", str(bad)),
            ("report", str(bad)),
            ("show", str(bad), "--json"),
        ):
            code, _, err = _cli(*cmd)
            assert code in (0, 1), (cmd, err)
            assert "Traceback" not in err and "internal error" not in err, (cmd, mutations, err)
            assert err.count("\n") <= 1, err
        with TestClient(create_app(served, warm=0), base_url="http://127.0.0.1") as client:
            _no_500(client, "bad")
            assert client.get("/api/runs/good/report.json").status_code == 200

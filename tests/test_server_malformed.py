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

from torchdebug.server import create_app  # noqa: E402

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

    with TestClient(create_app(served, warm=0)) as client:
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

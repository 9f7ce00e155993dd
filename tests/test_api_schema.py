"""schemathesis against the live API over real HTTP: no 5xx, no response off its OpenAPI document."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import jsonschema_rs
import pytest

from replyd.api import openapi_document
from tests.api_harness import ROOT, TOKEN, running

SCHEMATHESIS = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"]


def st_run(url: str, workdir, *, hooks: bool, env: dict[str, str], examples: int = 25) -> subprocess.CompletedProcess:
    """Run `schemathesis run` with every check against the live API; return the finished process."""
    args = [*SCHEMATHESIS, "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", str(examples),
            "--seed", "20261129", "-H", f"Authorization: Bearer {TOKEN}", "--no-color"]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    if hooks:
        full_env["SCHEMATHESIS_HOOKS"] = "tests.api_schemathesis_hooks"
    return subprocess.run(args, capture_output=True, text=True, cwd=workdir, env=full_env, timeout=540)


def test_openapi_document_is_valid_openapi_31():
    """The document is OpenAPI 3.1 whose schemas are valid JSON Schema, for both auth modes."""
    for auth in (False, True):
        doc = openapi_document(auth=auth, open_routes=["readyz"] if auth else [])
        assert doc["openapi"] == "3.1.0"
        # Components refer to components at any depth: every reference is resolved inside $defs.
        defs = json.loads(json.dumps(doc["components"]["schemas"]).replace("#/components/schemas/", "#/$defs/"))
        for schema in defs.values():
            jsonschema_rs.validator_for({**schema, "$defs": defs})  # raises if invalid
        body = doc["paths"]["/v1/replies"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["required"] == ["platform", "parent_id", "text"] and body["additionalProperties"] is False


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_violation(tmp_path, monkeypatch):
    """Coverage and fuzzing phases, every check, once with random data and once aimed at real parents."""
    with running(tmp_path, monkeypatch) as h:
        served = httpx.get(f"{h.url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert served == json.loads(json.dumps(openapi_document(auth=True)))
        parents = [h.parent() for _ in range(6)]
        with h.client() as c:  # one answered parent, one refused one: already_answered and rearm are reachable
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": parents[0], "text": "hi"}).status_code == 201
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": parents[1], "text": "x" * 600}).status_code == 409
        plain = st_run(h.url, tmp_path, hooks=False, env={})
        assert plain.returncode == 0, plain.stdout[-6000:] + plain.stderr[-2000:]
        parents[1] = h.parent()  # a refused parent of its own: a POST /v1/rearm of the plain run may have released the first
        with h.client() as c:
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": parents[1], "text": "x" * 600}).status_code == 409
        aimed = st_run(h.url, tmp_path, hooks=True, env={"REPLYD_ST_BOT": "sim", "REPLYD_ST_PARENTS": ",".join(parents)})
        assert aimed.returncode == 0, aimed.stdout[-6000:] + aimed.stderr[-2000:]
        # Confirm acts only on an unconfirmed row, which the sim (it reads back) never leaves: its 404s are the
        # one expected "missing test data"; tests/test_telegram.py reaches its compare-and-set and 409.
        missing = re.findall(r"^\s*- (\w+ \S+)$", aimed.stdout.split("Missing test data", 1)[1].split("\n\n\n")[0],
                             re.M) if "Missing test data" in aimed.stdout else []
        assert set(missing) <= {"POST /v1/replies/{platform}/{parent_id}/confirm"}, aimed.stdout[-4000:]
        report = h.world.report()
        # The fuzzer posted for real: still at most one reply per parent.
        assert report["duplicates"] == 0, report
        assert sum(h.bot_replies(p) for p in parents) >= 2, report

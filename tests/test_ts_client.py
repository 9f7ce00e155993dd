"""The TypeScript client's committed OpenAPI document is the one the code serves now (its types never drift)."""

from __future__ import annotations

import json
from pathlib import Path

from replyd.api.openapi import openapi_document

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "clients" / "typescript" / "openapi.json"


def test_committed_openapi_matches_the_code() -> None:
    """A changed route or model fails here until `make ts-openapi` rewrites the file and the types."""
    assert json.loads(COMMITTED.read_text()) == openapi_document(), (
        f"{COMMITTED.relative_to(ROOT)} is out of date: run `make ts-openapi` and commit it with src/schema.ts")

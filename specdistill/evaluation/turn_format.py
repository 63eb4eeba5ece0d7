"""Recorded turns: what one user message costs in LLM calls, with their dependencies and pauses.

A turn is a small DAG of calls. A call starts when every call it depends on has finished, plus its recorded
pause (client-side work: parsing the previous answer, a search request); a call with no dependency starts at
the turn's start plus its pause. The turn ends when its last call ends. One turn per JSONL line:

    {"turn_id": "heldout-0-t0", "calls": [
        {"id": "context_parsing-0", "stage": "context_parsing", "depends_on": [], "pause_s": 0.004,
         "prompt_token_ids": [...], "max_tokens": 41, "expects_json": true}, ...]}

`turns_from_rows` builds turns from the synthetic workload (specdistill/data/synthetic.py rows, 26 calls per message in
specdistill.data.workload.STAGE_CALLS order): each stage's calls run in parallel and depend on all calls of the stage before
(context -> preferences -> queries -> filters -> answer), the shape of the production pipeline.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdistill.data.workload import STAGE_CALLS, STAGES

JSON_STAGES = ("context_parsing", "preference_extraction", "search_queries", "filter_selection")


@dataclass(frozen=True)
class Call:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    depends_on: list[str] = field(default_factory=list)
    pause_s: float = 0.0
    stage: str | None = None
    expects_json: bool = False


@dataclass(frozen=True)
class Turn:
    turn_id: str
    calls: list[Call]

    def __post_init__(self):
        ids = [c.id for c in self.calls]
        if len(set(ids)) != len(ids):
            raise ValueError(f"turn {self.turn_id}: duplicate call ids {sorted({i for i in ids if ids.count(i) > 1})}")
        seen: set[str] = set()
        for c in self.calls:  # calls listed in an order that respects dependencies: no cycle possible
            missing = [d for d in c.depends_on if d not in seen]
            if missing:
                raise ValueError(f"turn {self.turn_id}, call {c.id}: depends_on {missing} not among the calls "
                                 "listed before it (list calls in dependency order)")
            seen.add(c.id)


def read_turns(path: str | Path) -> list[Turn]:
    turns = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            try:
                turns.append(Turn(obj["turn_id"], [Call(**c) for c in obj["calls"]]))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a recorded turn ({e}); fields: turn_id, calls[{{id, "
                                 "prompt_token_ids, max_tokens, depends_on, pause_s, stage, expects_json}]") from None
    return turns


def write_turns(turns: list[Turn], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for t in turns:
            f.write(json.dumps(asdict(t)) + "\n")


def split_messages(rows: list[dict]) -> list[list[dict]]:
    """Consecutive rows of one user message: a new one starts when the stage order goes back, or a stage
    already has its STAGE_CALLS calls (two truncated messages in a row)."""
    messages: list[list[dict]] = []
    for row in rows:
        if row.get("stage") not in STAGES:
            raise ValueError(f"row {row.get('id')!r}: field 'stage' is {row.get('stage')!r}; expected one of {STAGES}")
        current = messages[-1] if messages else []
        same_stage = sum(r["stage"] == row["stage"] for r in current)
        if not current or STAGES.index(row["stage"]) < STAGES.index(current[-1]["stage"]) \
                or same_stage == STAGE_CALLS[row["stage"]]:
            messages.append([])
        messages[-1].append(row)
    return messages


def turns_from_rows(rows: list[dict], max_tokens: int | None = None, pause_s: tuple[float, float] = (0.0, 0.02),
                    seed: int = 0) -> list[Turn]:
    """One turn per user message; max_tokens = the row's recorded response length (capped); pauses drawn
    uniformly from `pause_s` with `seed` (the synthetic workload records none)."""
    rng = random.Random(seed)
    turns = []
    for m, message in enumerate(split_messages(rows)):
        calls, previous_stage, current = [], [], []
        for row in message:
            if current and row["stage"] != calls[-1].stage:
                previous_stage, current = current, []
            mask = row["loss_mask"]
            if 1 not in mask:
                raise ValueError(f"row {row.get('id')!r}: loss_mask has no response token")
            recorded = sum(mask)
            call = Call(id=f"{row['stage']}-{len(current)}", prompt_token_ids=row["input_ids"][: mask.index(1)],
                        max_tokens=min(recorded, max_tokens) if max_tokens else recorded,
                        depends_on=list(previous_stage), pause_s=round(rng.uniform(*pause_s), 4),
                        stage=row["stage"], expects_json=row["stage"] in JSON_STAGES)
            calls.append(call)
            current.append(call.id)
        turns.append(Turn(f"{message[0].get('id', m)}-t{m}", calls))
    return turns

"""`make test-compose` (scripts/compose/test-compose.sh): the docker compose deployment,
built and run for real, checked through its published port with the official openai
client. The plain `make test` run has no Docker: it does not collect this folder, which is
collected only when the script hands a stack over (CONVEYOR_COMPOSE_PROJECT set).

The checks run in file order and share one stack, each bringing it to the state it needs
(mode, profiles, replicas) with an idempotent `docker compose up --wait` first.
"""

from __future__ import annotations

import os

import pytest

from tests.compose.stack import Stack

collect_ignore_glob = [] if os.environ.get("CONVEYOR_COMPOSE_PROJECT") else ["*"]


@pytest.fixture(scope="session")
def stack() -> Stack:
    return Stack.from_env()


@pytest.fixture(scope="session")
def model(stack: Stack) -> str:
    stack.up()
    return stack.client().models.list().data[0].id

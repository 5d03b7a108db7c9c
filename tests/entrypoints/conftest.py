"""Fixtures for the end-to-end server tests: one real server shared by the whole session."""
from __future__ import annotations

import pytest
from openai_server_utils import API_KEY, SERVER_ARGS, RemoteServer


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop_and_check()


@pytest.fixture(scope="session")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="session")
def auth_headers():
    return {"Authorization": f"Bearer {API_KEY}"}

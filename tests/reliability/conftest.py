"""Servers shared by the reliability tests, and the check that runs after every one of them:
each live server's block pool is whole again (nothing leaked, nothing left referenced)."""
from __future__ import annotations

import os
import sys

import pytest

# The server launcher and API key live with the other end-to-end server tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints"))

from reliability_utils import CACHED_SERVER_ARGS, LIVE_SERVERS, MAIN_SERVER_ARGS, start_server


@pytest.fixture(scope="session")
def main_server():
    """Prefix caching off, a small KV pool, unbounded waiting queue, API key required, fault hooks on."""
    server = start_server(MAIN_SERVER_ARGS, faults=True)
    yield server
    server.stop_and_check()


@pytest.fixture(scope="session")
def cached_server():
    """Prefix caching on and a bounded waiting queue (16); started without --host (the default bind)."""
    server = start_server(CACHED_SERVER_ARGS, host_args=[])
    yield server
    server.stop_and_check()


@pytest.fixture(scope="session", autouse=True)
def no_server_outlives_the_session():
    yield
    for server in LIVE_SERVERS:
        server.cleanup()  # kills any a failed test left running


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test():
    yield
    for server in list(LIVE_SERVERS):
        if not server.alive():
            LIVE_SERVERS.remove(server)
            continue
        server.assert_pool_whole()

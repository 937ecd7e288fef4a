"""The server the tests drive (``served.start_server`` with the tiny model) and tinker SDK clients pointed at it."""

from __future__ import annotations

import pytest
from served import TOKEN, start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    running = start_server(tiny_model_path, tmp_path_factory.mktemp("serve") / "root")
    yield running
    stop_server(running)


@pytest.fixture
def service_client(server):
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    yield client
    client.close("success").result()

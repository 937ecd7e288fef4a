"""The server the tests drive (``served.start_server`` with the tiny model) and tinker SDK clients pointed at it."""

from __future__ import annotations

import pytest
from served import MODEL, TOKEN, UNTIED, start_server, stop_server


@pytest.fixture(scope="module")
def models(tiny_model_path, tiny_untied_model_path) -> dict[str, str]:
    return {MODEL: tiny_model_path, UNTIED: tiny_untied_model_path}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    running = start_server(models, tmp_path_factory.mktemp("serve") / "root")
    yield running
    stop_server(running)


@pytest.fixture
def service_client(server):
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    yield client
    client.close("success").result()

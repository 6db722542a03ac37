"""Take docs/console.png, the admin console's picture in docs/operating.md: a broker with
a few sessions (some with a backlog), a block-list entry and retained messages,
seen in headless Chromium at 1280x800.

    .venv/bin/python -m tests.e2e.console_screenshot [docs/console.png]

Not a test: run by hand when the console changes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from selenium.webdriver.common.by import By

from app.admin_cli import AdminClient
from tests.conftest import free_port
from tests.e2e.admin import TOKEN, answering, persistent_subscriber, publish
from tests.e2e.admin import wait_for as _wait_for
from tests.e2e.browser import start_chromium, wait_for
from tests.e2e.clients import V5, V311, Paho
from tests.e2e.conftest import start_broker

BACKLOGS = {"meter-0017": 12, "meter-0042": 3, "valve-north-2": 0}
ONLINE = [("gateway-eu-1", V5), ("thermostat-kitchen", V311)]


def main(out: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="devicemq-screenshot-"))
    port = free_port("127.0.0.1")
    broker = start_broker(
        work / "broker",
        {"persistence.enabled": True, "admin.port": port, "admin.token": TOKEN},
    )
    clients: list[Paho] = []
    try:
        api = answering(AdminClient(f"http://127.0.0.1:{port}", TOKEN))
        for cid, n in BACKLOGS.items():
            persistent_subscriber(broker, cid, f"plant/{cid}/cmd").close()
            publish(broker, f"plant/{cid}/cmd", n, "console-demo-pub")
        for cid, version in ONLINE:
            client = Paho(broker, cid, version)
            client.connect()
            client.subscribe("plant/+/telemetry", 1)
            clients.append(client)
        for i in range(20):
            clients[0].publish(f"plant/meter-{i:04}/telemetry", b'{"kWh": 1.5}', qos=1)
        clients[0].publish("plant/line-1/status", b"running", qos=1, retain=True)
        clients[0].publish("plant/line-2/status", b"maintenance", qos=1, retain=True)
        api.call(
            "POST",
            "blocked",
            body={"kind": "client_id_regex", "value": "scanner-.*", "reason": "port scan"},
        )
        api.call(
            "POST",
            "blocked",
            body={"kind": "address", "value": "203.0.113.0/24", "reason": "abuse", "ttl": 86400},
        )
        _wait_for(
            lambda: api.call("GET", api.session_path("meter-0017"))["backlog"] == 12,
            "the backlog stored",
        )

        driver = start_chromium(work / "chromium", size=(1280, 800))
        try:
            # --window-size is the window's: grow it until the page itself is 1280x800
            inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
            driver.set_window_size(1280 + 1280 - inner[0], 800 + 800 - inner[1])
            driver.get(api.url + "/")
            driver.find_element(By.ID, "token").send_keys(TOKEN)
            driver.find_element(By.ID, "token-save").click()
            wait_for(
                driver,
                lambda d: (
                    len(d.find_elements(By.CSS_SELECTOR, "#sessions-body tr")) == 5
                    and len(d.find_elements(By.CSS_SELECTOR, "#blocked-body tr")) == 2
                ),
                "the sessions and the block list",
            )
            # readiness, then the second refresh of the headline numbers fills the rates in
            wait_for(
                driver,
                lambda d: (
                    d.find_element(By.CSS_SELECTOR, '[data-testid="stat-ready"] dd').text == "yes"
                ),
                "the broker ready",
            )
            wait_for(
                driver,
                lambda d: (
                    d.find_element(By.CSS_SELECTOR, '[data-testid="stat-in-rate"] dd').text != "—"
                ),
                "the message rates",
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    finally:
        for client in clients:
            client.close()
        broker.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/console.png"))

"""The admin API's web console (app/console/) in a real headless Chromium
(tests/e2e/browser.py), against a real broker with its embedded Redis and Tansu
and real MQTT clients (paho). What the page did is checked through the API.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec

from app.admin_cli import AdminClient
from tests.e2e import admin
from tests.e2e.admin import TOKEN, admin_broker, persistent_subscriber, publish
from tests.e2e.browser import wait_for
from tests.e2e.clients import V5, Paho
from tests.e2e.conftest import BrokerProcess, is_mosquitto

pytestmark = pytest.mark.skipif(is_mosquitto(), reason="devicemq's admin console")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, AdminClient]]:
    with admin_broker(tmp_path_factory.mktemp("console")) as running:
        yield running


def _open(driver: WebDriver, url: str) -> None:
    """The console in a fresh state: no token kept from an earlier test."""
    driver.get(url)
    driver.execute_script("sessionStorage.clear()")
    driver.get(url)


def _enter_token(driver: WebDriver, token: str) -> None:
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.ID, "token-save").click()


def _error(driver: WebDriver) -> str:
    element = driver.find_element(By.ID, "error")
    return str(element.text) if element.is_displayed() else ""


def _fact(driver: WebDriver, testid: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"] dd').text)


def _session_row(driver: WebDriver, client_id: str) -> WebElement | None:
    rows = driver.find_elements(By.CSS_SELECTOR, f'#sessions-body tr[data-client-id="{client_id}"]')
    return rows[0] if rows else None


def _sessions_listed(driver: WebDriver) -> list[str] | None:
    """The client IDs in the sessions table, once its latest request is answered."""
    if driver.find_element(By.ID, "sessions-table").get_attribute("aria-busy") != "false":
        return None
    rows = driver.find_elements(By.CSS_SELECTOR, "#sessions-body tr")
    return [r.get_attribute("data-client-id") or "" for r in rows]


def _open_session(driver: WebDriver, client_id: str) -> None:
    """Click the session's row (again, should the table be redrawn meanwhile)."""

    def click(d: WebDriver) -> bool:
        d.find_element(
            By.CSS_SELECTOR, f'#sessions-body button[data-client-id="{client_id}"]'
        ).click()
        return True

    wait_for(driver, click, f"{client_id}'s row to click")


def test_a_backlog_found_in_the_console_and_purged(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    broker, api = server
    cid, topic = "console-backlog", "console/backlog"
    sub = persistent_subscriber(broker, cid, topic)
    publish(broker, topic, 3, "console-publisher")
    admin.wait_for(
        lambda: api.call("GET", api.session_path(cid))["backlog"] == 3, "3 messages stored"
    )

    driver = chromium
    _open(driver, api.url + "/")
    _enter_token(driver, TOKEN)
    wait_for(driver, lambda d: _fact(d, "stat-sessions") not in ("", "—"), "the headline numbers")
    assert _error(driver) == ""

    search = driver.find_element(By.ID, "search-prefix")
    search.send_keys(cid)
    driver.find_element(By.ID, "search-button").click()
    wait_for(driver, lambda d: _sessions_listed(d) == [cid], f"the table narrowed to {cid}")
    row = _session_row(driver, cid)
    assert row is not None
    assert row.find_element(By.CSS_SELECTOR, '[data-testid="backlog"]').text == "3"
    _open_session(driver, cid)

    wait_for(driver, lambda d: _fact(d, "detail-backlog") == "3", "the detail's backlog of 3")
    assert driver.find_element(By.ID, "detail-client-id").text == cid
    assert _fact(driver, "detail-state") == "offline"
    assert _fact(driver, "detail-packet-ids") == "1 to 3"
    subscriptions = driver.find_elements(By.CSS_SELECTOR, "#detail-subscriptions tbody tr")
    assert [r.find_element(By.TAG_NAME, "td").text for r in subscriptions] == [topic]
    peeked = driver.find_elements(By.CSS_SELECTOR, "#detail-messages tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[-1].text for r in peeked] == ["m0", "m1", "m2"]

    driver.find_element(By.ID, "purge").click()
    alert = wait_for(driver, ec.alert_is_present(), "the confirm dialog")
    assert cid in alert.text and "Purge" in alert.text
    alert.accept()

    wait_for(
        driver,
        lambda d: "Purged 3 messages" in d.find_element(By.ID, "status").text,
        "the purge reported",
    )
    # the API says so ...
    assert api.call("GET", api.session_path(cid))["backlog"] == 0
    assert api.call("GET", api.session_path(cid, "messages"))["items"] == []
    # ... and so does the page, in the detail and in the table
    wait_for(driver, lambda d: _fact(d, "detail-backlog") == "0", "the detail's backlog of 0")
    assert driver.find_elements(By.CSS_SELECTOR, "#detail-messages tbody tr") == []
    wait_for(
        driver,
        lambda d: (
            (r := _session_row(d, cid)) is not None
            and r.find_element(By.CSS_SELECTOR, '[data-testid="backlog"]').text == "0"
        ),
        "the table's backlog of 0",
    )
    assert _error(driver) == ""
    # the session itself is kept
    assert sub.connect(clean_start=False).session_present
    sub.close()


def test_the_console_purges_the_session_dot_not_another(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    """Issue 45 #10: purging the session "." sent DELETE /api/v1/sessions/./messages,
    which the browser resolves to /api/v1/sessions/messages: the DELETE of the
    session named "messages". The console now marks such a segment (%00.)."""
    broker, api = server
    dot = persistent_subscriber(broker, ".", "console/dot")
    other = persistent_subscriber(broker, "messages", "console/other")
    publish(broker, "console/dot", 2, "console-dot-publisher")
    publish(broker, "console/other", 1, "console-other-publisher")
    admin.wait_for(
        lambda: (
            api.call("GET", api.session_path("."))["backlog"] == 2
            and api.call("GET", api.session_path("messages"))["backlog"] == 1
        ),
        "the messages stored",
    )
    driver = chromium
    _open(driver, api.url + "/")
    _enter_token(driver, TOKEN)
    search = driver.find_element(By.ID, "search-prefix")
    search.send_keys(".")
    driver.find_element(By.ID, "search-button").click()
    wait_for(driver, lambda d: _sessions_listed(d) == ["."], "the table narrowed to .")
    _open_session(driver, ".")
    wait_for(driver, lambda d: _fact(d, "detail-backlog") == "2", "the detail of . (backlog 2)")
    assert driver.find_element(By.ID, "detail-client-id").text == "."
    driver.find_element(By.ID, "purge").click()
    alert = wait_for(driver, ec.alert_is_present(), "the confirm dialog")
    alert.accept()
    wait_for(
        driver,
        lambda d: "Purged 2 messages" in d.find_element(By.ID, "status").text,
        "the purge reported",
    )
    assert api.call("GET", api.session_path("."))["backlog"] == 0
    # The session "messages" is untouched: still there, its message still stored.
    assert api.call("GET", api.session_path("messages"))["backlog"] == 1
    assert _error(driver) == ""
    assert dot.connect(clean_start=False).session_present
    assert other.connect(clean_start=False).session_present
    dot.close()
    other.close()


def test_without_the_token_the_page_shows_the_401_not_the_data(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    broker, api = server
    client = Paho(broker, "console-secret", V5)
    assert client.connect().reason_code == 0
    driver = chromium
    try:
        _open(driver, api.url + "/")
        error = wait_for(driver, _error, "the error line")
        assert error.startswith("401: ") and "enter the admin token" in error, error
        assert driver.find_elements(By.CSS_SELECTOR, "#sessions-body tr") == []
        assert driver.find_elements(By.CSS_SELECTOR, "#stats div") == []
        assert "console-secret" not in driver.page_source

        _enter_token(driver, "not-the-token")
        wait_for(driver, lambda d: "the token was refused" in _error(d), "the refused token")
        assert driver.find_elements(By.CSS_SELECTOR, "#sessions-body tr") == []

        _enter_token(driver, TOKEN)
        wait_for(
            driver, lambda d: _session_row(d, "console-secret"), "the sessions, with the token"
        )
        assert _error(driver) == ""
        # never in the URL; only in this tab's sessionStorage
        assert "not-the-token" not in driver.current_url and TOKEN not in driver.current_url
        assert driver.execute_script("return sessionStorage.length") == 1
    finally:
        client.close()


def test_without_admin_token_the_console_is_read_only(tmp_path: Path, chromium: WebDriver) -> None:
    with admin_broker(tmp_path / "b", token=None, **{"persistence.enabled": False}) as (
        broker,
        api,
    ):
        client = Paho(broker, "console-ro", V5)
        assert client.connect().reason_code == 0
        driver = chromium
        _open(driver, api.url + "/")
        wait_for(driver, lambda d: _session_row(d, "console-ro"), "the session listed")
        _open_session(driver, "console-ro")
        wait_for(driver, lambda d: _fact(d, "detail-state") == "connected", "the detail")
        driver.find_element(By.ID, "kick").click()
        wait_for(driver, ec.alert_is_present(), "the confirm dialog").accept()
        error = wait_for(driver, _error, "the error line")
        assert error.startswith("403: ") and "token" in error, error
        assert client.connected
        client.close()


def test_integration_rules_and_their_counts_in_the_headline(
    tmp_path: Path, chromium: WebDriver
) -> None:
    """The audit count per integration rule is in the admin stats, so in the console."""
    rules = '[{"name": "all", "topic_filter": "console/#", "kafka_topic": "console.all"}]'
    with admin_broker(tmp_path / "b", **{"persistence.enabled": False, "integrations": rules}) as (
        broker,
        api,
    ):
        client = Paho(broker, "console-rules", V5)
        assert client.connect().reason_code == 0
        for _ in range(3):
            assert client.publish("console/x", b"m", qos=1) == 0
        driver = chromium
        _open(driver, api.url + "/")
        _enter_token(driver, TOKEN)
        wait_for(driver, lambda d: _fact(d, "stat-rule-all") == "3 / 0", "the rule's count")
        client.close()


# -- issue 40: readiness, auto-refresh, UTC times ---------------------------------------------

REFRESH_S = 5.0  # console.js REFRESH_EVERY_MS


def _utc(epoch: float) -> str:
    """How the CLI writes a time (app/admin_cli.py), which the console must match."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + "Z"


def _refreshes(driver: WebDriver) -> int:
    return int(driver.find_element(By.ID, "updated").get_attribute("data-refreshes") or 0)


def test_auto_refresh_readiness_and_utc_times(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    """The headline shows /ready's answer and the Kafka lag; the sessions table
    follows the broker without a click while Auto-refresh is on, and not when it
    is off; times are UTC (as the CLI prints them) whatever the browser's zone."""
    broker, api = server
    driver = chromium
    # a browser far from UTC (+14 h): local times would show another day
    driver.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": "Pacific/Kiritimati"})
    late: list[Paho] = []
    try:
        _open(driver, api.url + "/")
        _enter_token(driver, TOKEN)
        wait_for(driver, lambda d: _fact(d, "stat-ready") == "yes", "Ready: yes")
        ready = driver.find_element(By.CSS_SELECTOR, '[data-testid="stat-ready"]')
        assert "ready" in (ready.get_attribute("class") or "").split()
        assert _fact(driver, "stat-kafka-lag").isdigit()
        health = api.call("GET", "stats")["health"]
        assert health["ready"] is True and health["reason"] is None

        # a session made after the page loaded shows up by itself, at a refresh
        wait_for(driver, lambda d: _sessions_listed(d) is not None, "the first load")
        cid = "console-auto-1"
        before = _refreshes(driver)
        persistent_subscriber(broker, cid, "console/auto").close()
        row = wait_for(
            driver,
            lambda d: _refreshes(d) > before + 1 and _session_row(d, cid),
            f"{cid} without a click",
        )
        last_seen = api.call("GET", api.session_path(cid))["last_seen"]
        cells = row.find_elements(By.TAG_NAME, "td")
        assert cells[-1].text == _utc(last_seen)
        assert driver.execute_script("return new Date().getTimezoneOffset()") == -14 * 60
        updated = driver.find_element(By.ID, "updated").text
        assert updated.startswith("updated ") and updated.endswith("Z")

        # off: nothing changes by itself any more
        driver.find_element(By.ID, "auto-refresh").click()
        assert not driver.find_element(By.ID, "auto-refresh").is_selected()
        before = _refreshes(driver)
        client = Paho(broker, "console-auto-2", V5)
        late.append(client)
        assert client.connect().reason_code == 0
        time.sleep(REFRESH_S * 1.6)  # more than one refresh interval: none may come
        assert _refreshes(driver) == before
        assert _session_row(driver, "console-auto-2") is None
        # on again: it comes
        driver.find_element(By.ID, "auto-refresh").click()
        wait_for(driver, lambda d: _session_row(d, "console-auto-2"), "the refresh turned on")
        assert _error(driver) == ""
    finally:
        driver.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": ""})
        for client in late:
            client.close()


def test_the_console_shows_a_broker_that_lost_redis_and_kafka(
    tmp_path: Path, chromium: WebDriver
) -> None:
    """Its embedded Redis and Kafka stopped under it: the headline turns to "no"
    with /ready's reason, by itself (auto-refresh)."""
    with admin_broker(tmp_path / "b") as (broker, api):
        driver = chromium
        _open(driver, api.url + "/")
        _enter_token(driver, TOKEN)
        wait_for(driver, lambda d: _fact(d, "stat-ready") == "yes", "Ready: yes")
        broker.stop_services()
        wait_for(
            driver,
            lambda d: _fact(d, "stat-ready").startswith("no: redis unreachable"),
            "Ready: no, naming Redis",
            timeout=30,
        )
        ready = driver.find_element(By.CSS_SELECTOR, '[data-testid="stat-ready"]')
        assert "not-ready" in (ready.get_attribute("class") or "").split()
        assert api.call("GET", "stats")["health"]["ready"] is False


def _queue_row(driver: WebDriver, queue: str) -> WebElement | None:
    for row in driver.find_elements(By.CSS_SELECTOR, "#queues-body tr"):
        if row.get_attribute("data-queue") == queue:
            return row
    return None


def _queue_cell(driver: WebDriver, queue: str, testid: str) -> str:
    row = _queue_row(driver, queue)
    return (
        ""
        if row is None
        else str(row.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]').text)
    )


def _show_queues(driver: WebDriver) -> None:
    driver.find_element(By.ID, "queues-show").click()


def test_queues_listed_a_group_store_purged_and_an_ecq_rewound(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    """The $ECQ queue and the $queue group store, each with its backlog; the group
    store's ID ("/" and "+" in it) reaches the right store when purged."""
    broker, api = server
    queue, group = "console-ecq", "$queue/cg/console-group/+"
    persistent_subscriber(broker, "console-member", group)  # a member, offline
    producer = Paho(broker, "console-producer", V5)
    producer.connect()
    for topic in ("console-group/a", "console-group/b", "console-group/c"):
        assert producer.publish(topic, b"g", qos=1) == 0
    for key in ("k1", "k2"):
        assert producer.publish(f"$ECQ/w/{queue}/{key}", key.encode(), qos=1) == 0
    producer.disconnect()
    group_path = "queues/" + quote(group, safe="")
    admin.wait_for(lambda: api.call("GET", group_path)["pending"] == 3, "3 entries in the group")
    # The queue's consumer takes both entries and acknowledges them: nothing pending.
    consumer = Paho(broker, queue, V5)
    consumer.connect()
    assert consumer.subscribe(f"$ECQ/{queue}/#", 1) == [1]
    assert sorted(m.payload for m in consumer.get_n(2)) == [b"k1", b"k2"]
    admin.wait_for(lambda: api.call("GET", f"queues/{queue}")["pending"] == 0, "both acknowledged")
    consumer.close()
    owner = api.call("GET", f"queues/{queue}/owner")["owner"]

    driver = chromium
    _open(driver, api.url + "/")
    _enter_token(driver, TOKEN)
    wait_for(driver, lambda d: _queue_row(d, group), "the group store's row")
    assert _error(driver) == ""
    assert _queue_cell(driver, group, "queue-pending") == "3"
    assert _queue_cell(driver, group, "queue-bytes") == str(api.call("GET", group_path)["bytes"])
    assert _queue_cell(driver, group, "queue-holder") == "members subscribed"
    assert _queue_cell(driver, queue, "queue-pending") == "0"
    assert _queue_cell(driver, queue, "queue-holder") == "owner " + (owner or "—")

    row = _queue_row(driver, group)
    assert row is not None
    row.find_element(By.CSS_SELECTOR, '[data-testid="purge-queue"]').click()
    alert = wait_for(driver, ec.alert_is_present(), "the confirm dialog")
    assert group in alert.text and "Purge" in alert.text
    alert.accept()
    wait_for(driver, lambda d: _queue_row(d, group) is None, "the purged store gone from the list")
    status = driver.find_element(By.ID, "status").text
    assert status.startswith(f"Purged {group}: 3 entries (3 pending)"), status
    assert api.call("GET", group_path)["pending"] == 0
    assert api.call("GET", f"queues/{queue}")["last_seq"] == 2  # the other queue untouched

    row = _queue_row(driver, queue)
    assert row is not None
    row.find_element(By.CSS_SELECTOR, '[data-testid="rewind-queue"]').click()
    prompt = wait_for(driver, ec.alert_is_present(), "the sequence number prompt")
    assert queue in prompt.text
    prompt.send_keys("1")
    prompt.accept()
    wait_for(driver, lambda d: _queue_cell(d, queue, "queue-pending") == "2", "2 pending again")
    assert driver.find_element(By.ID, "status").text == (
        f"Rewound {queue} from 1: 2 entries pending again."
    )
    assert api.call("GET", f"queues/{queue}")["pending"] == 2


def test_a_session_rewound_from_its_detail(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    """Purged, then rewound to a time before its messages: they are stored again."""
    broker, api = server
    cid, topic = "console-rewind", "console/rewind"
    persistent_subscriber(broker, cid, topic)
    since = int(time.time()) - 1
    publish(broker, topic, 3, "console-rewind-publisher")
    path = api.session_path(cid)
    admin.wait_for(lambda: api.call("GET", path)["backlog"] == 3, "3 messages stored")
    api.call("DELETE", api.session_path(cid, "messages"))
    assert api.call("GET", path)["backlog"] == 0

    driver = chromium
    _open(driver, api.url + "/")
    _enter_token(driver, TOKEN)
    wait_for(driver, lambda d: _session_row(d, cid), f"{cid}'s row")
    _open_session(driver, cid)
    wait_for(driver, lambda d: _fact(d, "detail-backlog") == "0", "the detail, purged")
    driver.find_element(By.ID, "rewind-since").send_keys(str(since))
    driver.find_element(By.ID, "rewind").click()
    alert = wait_for(driver, ec.alert_is_present(), "the confirm dialog")
    assert cid in alert.text
    alert.accept()
    wait_for(driver, lambda d: _fact(d, "detail-backlog") == "3", "3 stored again")
    assert driver.find_element(By.ID, "status").text.startswith(
        f"Rewound {cid}: 3 messages stored again"
    )
    assert _error(driver) == ""
    peeked = driver.find_elements(By.CSS_SELECTOR, "#detail-messages tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[-1].text for r in peeked] == ["m0", "m1", "m2"]


def test_who_subscribes_to_a_topic_and_the_replicas(
    server: tuple[BrokerProcess, AdminClient], chromium: WebDriver
) -> None:
    broker, api = server
    watchers = []
    for cid, topic_filter in (
        ("console-who-1", "console-who/+"),
        ("console-who-2", "$share/ops/console-who/#"),
    ):
        client = Paho(broker, cid, V5)
        assert client.connect().reason_code == 0
        assert client.subscribe(topic_filter, 1) == [1]
        watchers.append(client)
    node = api.call("GET", "stats")["node"]
    try:
        driver = chromium
        _open(driver, api.url + "/")
        _enter_token(driver, TOKEN)
        wait_for(
            driver,
            lambda d: d.find_elements(By.CSS_SELECTOR, f'#replicas-body tr[data-node="{node}"]'),
            "this replica listed",
        )
        row = driver.find_element(By.CSS_SELECTOR, f'#replicas-body tr[data-node="{node}"]')
        assert row.find_elements(By.TAG_NAME, "td")[0].text == f"{node} (this one)"
        assert int(row.find_element(By.CSS_SELECTOR, '[data-testid="replica-connected"]').text) >= 2

        driver.find_element(By.ID, "subscribers-topic").send_keys("console-who/x")
        driver.find_element(By.ID, "subscribers-ask").click()
        wait_for(
            driver, lambda d: d.find_element(By.ID, "subscribers-note").is_displayed(), "the answer"
        )
        rows = driver.find_elements(By.CSS_SELECTOR, "#subscribers-body tr")
        seen = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        assert seen == [
            ["console-who-1", "console-who/+", "1", "—", node],
            ["console-who-2", "$share/ops/console-who/#", "1", "shared ops", node],
        ], seen
        assert driver.find_element(By.ID, "subscribers-note").text == (
            "2 subscriptions match console-who/x."
        )

        field = driver.find_element(By.ID, "subscribers-topic")
        field.clear()
        field.send_keys("console-who/#")
        driver.find_element(By.ID, "subscribers-ask").click()
        error = wait_for(driver, _error, "the error line")
        assert error.startswith("400: topic:"), error
    finally:
        for client in watchers:
            client.close()

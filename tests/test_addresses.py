"""Webhook targets judged by IANA's special-purpose registries and the clouds' metadata addresses (issue 36 item 5):
one address inside each block is refused, at submit and at delivery, naming the block; addresses Python's
`ipaddress.is_global` calls global but that are not (192.0.0.192, a metadata address) are refused too, and NAT64 /
mapped / 6to4 forms are judged by what they carry. Public addresses stay public."""

from __future__ import annotations

import ipaddress

import pytest

from app.adapters import addresses, webhooks
from app.core.config import Settings


def _inside(block: str) -> str:
    """An address inside `block`, away from its edges where the block allows it."""
    network = ipaddress.ip_network(block)
    return str(network[min(network.num_addresses - 1, 7)])


def _url(address: str) -> str:
    return f"http://[{address}]/" if ":" in address else f"http://{address}/"


@pytest.mark.parametrize(
    "block, name", addresses.SPECIAL_PURPOSE, ids=[block for block, _ in addresses.SPECIAL_PURPOSE]
)
def test_an_address_in_each_special_purpose_block_is_refused_naming_it(block, name):
    address = _inside(block)
    reason = addresses.why_not_public(ipaddress.ip_address(address))
    assert reason == f"{block}: {name}", (address, reason)
    _refused_everywhere(address)


@pytest.mark.parametrize(
    "address, name", addresses.METADATA_ADDRESSES, ids=[address for address, _ in addresses.METADATA_ADDRESSES]
)
def test_each_known_metadata_address_is_refused_naming_it(address, name):
    assert addresses.why_not_public(ipaddress.ip_address(address)) == f"{address}: {name}"
    _refused_everywhere(address)


def test_what_python_calls_global_is_not_taken_on_trust():
    """The issue's find: 192.0.0.192 passed `is_global` (and the old check) and was POSTed to."""
    oracle = ipaddress.ip_address("192.0.0.192")
    assert oracle.is_global  # Python's view, the reason for the registry table
    assert not webhooks.public(oracle)


@pytest.mark.parametrize(
    "address, carried",
    [
        ("64:ff9b::a00:1", "10.0.0.1"),  # NAT64 of a private address
        ("64:ff9b::c000:c0", "192.0.0.192"),  # NAT64 of a metadata address
        ("64:ff9b::6464:64c8", "100.100.100.200"),
        ("2002:c612:1::", "198.18.0.1"),  # 6to4 of a benchmarking address
    ],
)
def test_ipv6_forms_are_judged_by_the_ipv4_address_they_carry(address, carried):
    reason = addresses.why_not_public(ipaddress.ip_address(address))
    assert reason is not None and carried in reason, reason
    _refused_everywhere(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700:4700::1111", "64:ff9b::808:808"])
def test_public_addresses_stay_public(address):
    assert addresses.why_not_public(ipaddress.ip_address(address)) is None
    assert (
        webhooks.refusal(
            webhooks.parse_url(_url(address)), ipaddress.ip_address(address), Settings(webhook_secret="whsec_dGVzdA==")
        )
        is None
    )


def _refused_everywhere(address: str) -> None:
    """Refused at submit (400 naming `webhook`) and at delivery, before any connection."""
    url = _url(address)
    with pytest.raises(webhooks.WebhookRefused) as refused:
        webhooks.check_target(url, None, Settings(webhook_secret="whsec_dGVzdA=="))
    assert refused.value.field == "webhook", url
    status, error = webhooks.post(url, "{}", {}, 2, Settings(webhook_secret="whsec_dGVzdA=="))
    assert status is None and error.startswith("refused: "), (url, status, error)

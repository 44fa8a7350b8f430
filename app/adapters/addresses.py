"""Which IP addresses are on the public internet, judged by IANA's special-purpose address registries, not by
Python's `ipaddress.is_global` alone (Python 3.11 calls 192.0.0.192, a cloud metadata address in 192.0.0.0/24,
global), plus the platform addresses clouds serve metadata or control traffic on.

Every block the registries list is refused as a webhook target, including the few they mark globally reachable
(anycast relays such as 192.0.0.9, AS112 sinks): none of them is a place a client's receiver lives. An IPv6
address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64) is judged by what it carries as well.

Sources: https://www.iana.org/assignments/iana-ipv4-special-registry and iana-ipv6-special-registry (read
2026-12), the IPv4/IPv6 multicast registries, and the clouds' documented metadata endpoints.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

SPECIAL_PURPOSE: tuple[tuple[str, str], ...] = (  # (block, what IANA calls it)
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private use"),
    ("100.64.0.0/10", "shared address space"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link local"),
    ("172.16.0.0/12", "private use"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "AS112-v4"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.168.0.0/16", "private use"),
    ("192.175.48.0/24", "direct delegation AS112 service"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "limited broadcast"),
    ("::/128", "unspecified address"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible (deprecated)"),
    ("64:ff9b:1::/48", "IPv4-IPv6 translation, local use"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy IPv6 prefix"),
    ("2001::/23", "IETF protocol assignments"),
    ("2001:db8::/32", "documentation"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing (SRv6) SIDs"),
    ("fc00::/7", "unique local"),
    ("fe80::/10", "link-local unicast"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
)
# Platform addresses outside those blocks, or worth naming: clouds answer metadata or control requests there.
METADATA_ADDRESSES: tuple[tuple[str, str], ...] = (
    ("169.254.169.254", "cloud metadata service (AWS, GCP, Azure, OpenStack, ...)"),
    ("169.254.170.2", "AWS ECS task metadata"),
    ("169.254.0.23", "Tencent Cloud metadata"),
    ("100.100.100.200", "Alibaba Cloud metadata"),
    ("192.0.0.192", "Oracle Cloud metadata"),
    ("168.63.129.16", "Azure platform (wireserver)"),
    ("fd00:ec2::254", "AWS metadata over IPv6"),
    ("fd00:ec2::23", "AWS DNS over IPv6"),
)
_BLOCKS: tuple[tuple[Network, str], ...] = tuple((ipaddress.ip_network(block), name) for block, name in SPECIAL_PURPOSE)
_METADATA = {ipaddress.ip_address(address): name for address, name in METADATA_ADDRESSES}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: global itself, judged by what it carries


def why_not_public(address: IPAddress) -> str | None:
    """What makes `address` unfit as a public target ("192.0.0.0/24: IETF protocol assignments", "carries
    10.0.0.1: private use", ...), or None when it is on the public internet."""
    if address in _METADATA:
        return f"{address}: {_METADATA[address]}"
    containing = [(block, name) for block, name in _BLOCKS if address.version == block.version and address in block]
    if containing:  # the most specific block names it (255.255.255.255 is the limited broadcast, not just 240/4)
        block, name = max(containing, key=lambda entry: entry[0].prefixlen)
        return f"{block}: {name}"
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            return f"{address}: a scoped (zone) address"
        for inner in _carried(address):
            reason = why_not_public(inner)
            if reason:
                return f"carries {inner} ({reason})"
    if not address.is_global:  # a block Python knows that the table above lacks (a newer registry entry)
        return f"{address}: not global"
    return None


def _carried(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one carries: mapped (::ffff:a.b.c.d), 6to4 (2002::/16), Teredo, NAT64."""
    inner = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
    if address in _NAT64:
        inner.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return [embedded for embedded in inner if embedded is not None]


def is_public(address: IPAddress) -> bool:
    return why_not_public(address) is None

"""A packet capture on the emulated hosts' bridge (tests/tier2/test_tier2_security.py), with nothing
but a raw socket: run in the bridge's network namespace, it records every TCP segment with a
payload that crosses a host's port (``v<k>``) until SIGTERM, then writes them to ``out`` as
``[u32 length][json {src, sport, dst, dport, seq}][u32 length][payload]`` records.
Usage: python bridge_sniffer.py OUT  (prints "ready" once it captures)"""

import json
import select
import signal
import socket
import struct
import sys

ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33


def segments(frame: bytes):
    """``(src, sport, dst, dport, seq, payload)`` of an Ethernet frame holding IPv4 TCP with data."""
    if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack_from("!H", ip, 2)[0]
    if ip[9] != 6 or total < ihl + 20:
        return None
    tcp = ip[ihl:total]
    sport, dport, seq = struct.unpack_from("!HHI", tcp, 0)
    payload = tcp[(tcp[12] >> 4) * 4 :]
    if not payload:
        return None
    return socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport, seq, payload


def main(out: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # root: past rmem_max, so nothing drops
    print("ready", flush=True)
    with open(out, "wb") as f:
        while not stop:
            if not select.select([sock], [], [], 0.5)[0]:  # the timeout only lets SIGTERM be seen
                continue
            frame, where = sock.recvfrom(1 << 18)
            got = segments(frame) if where[0].startswith("v") else None  # a host's port, not br0 or lo
            if got is not None:
                head = json.dumps(dict(zip(("src", "sport", "dst", "dport", "seq"), got[:5]))).encode()
                f.write(struct.pack("<I", len(head)) + head + struct.pack("<I", len(got[5])) + got[5])


if __name__ == "__main__":
    main(sys.argv[1])

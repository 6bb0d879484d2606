"""Zero the device code of every GPU architecture but one in a shared library's CUDA fatbin, in place.

Used to carry Transformer Engine's core library (`libtransformer_engine.so`, 343 MB with cubins for sm_75 to sm_120)
to the project's offline GPU machines, whose transfers are limited to 64 MiB: the zeroed payloads compress to almost
nothing, every header stays as it was (so offsets and sizes hold), and the CUDA runtime loads the kept architecture's
cubin. A library pruned this way runs only on that architecture. Development tooling, not part of the package.

usage: python scripts/device/prune_fatbin.py LIBRARY [--keep-sm 90]
"""

import argparse
import struct

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(data: bytes) -> tuple[int, int]:
    """(offset, size) of the ELF64 section ``.nv_fatbin``."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = data.index(b"\0", str_off + name)
        if data[str_off + name:end] == b".nv_fatbin":
            return offset, size
    raise ValueError("no .nv_fatbin section")


def prune(buf: bytearray, keep_sm: int) -> tuple[int, int]:
    """Zero the payload of every fatbin entry whose architecture is not ``keep_sm``; (bytes zeroed, bytes kept)."""
    start, size = fatbin_section(bytes(buf))
    pos, end_section, zeroed, kept = start, start + size, 0, 0
    while pos < end_section:
        magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", buf, pos)
        if magic != FATBIN_MAGIC:  # padding between containers
            pos += 8
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry < end:
            _, _, entry_header, payload = struct.unpack_from("<HHII", buf, entry)
            sm, = struct.unpack_from("<I", buf, entry + 28)
            body = entry + entry_header
            if sm == keep_sm:
                kept += payload
            else:
                buf[body:body + payload] = bytes(payload)
                zeroed += payload
            entry = body + payload
        pos = end
    return zeroed, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("library")
    p.add_argument("--keep-sm", type=int, default=90)
    args = p.parse_args()
    with open(args.library, "rb") as f:
        buf = bytearray(f.read())
    zeroed, kept = prune(buf, args.keep_sm)
    if not kept:
        raise SystemExit(f"no sm_{args.keep_sm} code in {args.library}: left unchanged")
    with open(args.library, "wb") as f:
        f.write(buf)
    print(f"{args.library}: zeroed {zeroed >> 20} MiB of other architectures, "
          f"kept {kept >> 20} MiB of sm_{args.keep_sm}")


if __name__ == "__main__":
    main()

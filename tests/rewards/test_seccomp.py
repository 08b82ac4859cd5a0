"""The seccomp program, without a kernel: its syscall numbers against the kernel's own headers, and
what it returns for each call, architecture and flag, run on a small classic-BPF interpreter written
here from linux/filter.h (an independent reading of the instructions)."""

import re
import struct

import pytest
from sandbox_helpers import run

from prorl.rewards import sandbox
from prorl.rewards.sandbox import seccomp

HEADERS = {
    "x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
    "aarch64": "/usr/include/asm-generic/unistd.h",
}


@pytest.mark.parametrize("machine", list(HEADERS))
def test_syscall_numbers_match_the_kernel_headers(machine):
    try:
        with open(HEADERS[machine]) as f:
            text = f.read()
    except OSError:
        pytest.skip(f"{HEADERS[machine]} is not installed (linux-libc-dev)")
    defined = {m[0]: int(m[1]) for m in re.findall(r"#define __NR_(\w+)\s+(\d+)\b", text)}
    col = 0 if machine == "x86_64" else 1
    assert {n: nums[col] for n, nums in seccomp.SYSCALLS.items()} == {
        n: defined[n] for n in seccomp.SYSCALLS
    }


def run_bpf(prog: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """Classic BPF over a struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]} (little
    endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    a, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        cls = code & 0x07
        if cls == 0x00:  # BPF_LD, must be W | ABS
            assert code == 0x20 and k % 4 == 0
            a = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif cls == 0x05:  # BPF_JMP with a constant
            op = code & 0xF0
            taken = {0x10: a == k, 0x30: a >= k, 0x40: bool(a & k)}[op]
            pc += 1 + (jt if taken else jf)
        elif cls == 0x06:  # BPF_RET | K
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


ARCH_I386, CLONE_NEWNS = 0x40000003, 0x00020000
DENY, NOSYS = seccomp.RET_ERRNO | 1, seccomp.RET_ERRNO | 38


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_program_denies_what_it_says_and_allows_the_rest(machine):
    prog = seccomp.program(machine)
    col, arch = int(machine != "x86_64"), seccomp.AUDIT_ARCH[machine]
    num = {n: v[col] for n, v in seccomp.SYSCALLS.items()}
    for name in (
        "add_key",
        "keyctl",
        "request_key",
        "ptrace",
        "mount",
        "bpf",
        "setns",
        "io_uring_setup",
    ):
        assert run_bpf(prog, num[name], arch) == DENY, name
    assert run_bpf(prog, num["clone3"], arch) == NOSYS
    for call in ("unshare", "clone"):
        assert run_bpf(prog, num[call], arch, (0x10000000, 0, 0, 0, 0, 0)) == DENY
        assert run_bpf(prog, num[call], arch, (0x10000000 | CLONE_NEWNS | 17,) + (0,) * 5) == DENY
        # threads
        assert run_bpf(prog, num[call], arch, (0x3D0F00 | 17, 0, 0, 0, 0, 0)) == seccomp.RET_ALLOW
        assert run_bpf(prog, num[call], arch, (1 << 32 | 17, 0, 0, 0, 0, 0)) == seccomp.RET_ALLOW
    denied = set(num.values()) - {num["clone"], num["unshare"]}
    for nr in range(460):  # everything else is allowed
        if nr not in denied:
            assert run_bpf(prog, nr, arch) == seccomp.RET_ALLOW, nr
    # another ABI (i386's int 0x80 table) or x32 numbers: the process is killed
    assert run_bpf(prog, 39, ARCH_I386) == seccomp.RET_KILL_PROCESS
    if machine == "x86_64":
        assert run_bpf(prog, 0x40000000 | 39, arch) == seccomp.RET_KILL_PROCESS


def test_unknown_architecture_has_no_program():
    assert seccomp.program("riscv64") is None


def test_a_filter_the_kernel_refuses_stops_the_sandbox_naming_it(monkeypatch):
    # fail closed: a run never goes ahead unfiltered because the filter could not be installed
    bad = struct.pack("=HBBI", 0x07, 0, 0, 0)  # BPF_MISC|TAX, not allowed in a seccomp filter
    monkeypatch.setattr(sandbox, "_filter_hex", lambda: bad.hex())
    with pytest.raises(sandbox.SandboxError, match="seccomp filter: Invalid argument"):
        run("print('ran')", sandbox.backend())


AF = {"unix": 1, "inet": 2, "inet6": 10, "netlink": 16, "packet": 17, "vsock": 40, "unspec": 0}


@pytest.mark.tally("attacks")
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_program_allows_only_unix_sockets_and_refuses_fallocate(machine):
    """Before: socket(AF_VSOCK) listened in a port space shared with the host, and fallocate took
    2 GiB of the host's disk past RLIMIT_FSIZE."""
    prog = seccomp.program(machine)
    col, arch = int(machine != "x86_64"), seccomp.AUDIT_ARCH[machine]
    num = {n: v[col] for n, v in seccomp.SYSCALLS.items()}
    for call in ("socket", "socketpair"):
        for family, value in AF.items():
            # SOCK_STREAM | SOCK_CLOEXEC in the second argument; the family alone decides
            got = run_bpf(prog, num[call], arch, (value, 0x80001, 0, 0, 0, 0))
            want = seccomp.RET_ALLOW if family == "unix" else seccomp.RET_ERRNO | 97
            assert got == want, (call, family)
        # the family is a 32-bit int: the upper half of the register does not make it AF_UNIX
        assert run_bpf(prog, num[call], arch, (1 << 32 | 40, 1, 0, 0, 0, 0)) != seccomp.RET_ALLOW
    assert run_bpf(prog, num["fallocate"], arch, (1, 1, 0, 2**31, 0, 0)) == seccomp.RET_ERRNO | 95

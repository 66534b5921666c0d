"""The sandbox's launcher: isolate this process, then exec Python on the program from stdin.

Run as a plain script (``python -I sandbox_exec.py LIMITS_JSON``) so that starting
it imports nothing heavy. In order, it:

1. (the parent starts it in a new session, and kills that whole process group
   on timeout);
2. enters new network, mount and PID namespaces (``unshare``): no interface but
   a down loopback, so no network; mounts made here are invisible outside; the
   program runs as PID 1 of its own PID namespace, so when it ends (or is
   killed) the kernel kills every process it started, daemons included;
3. mounts fresh, size-limited tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``
   (the world-writable places) and works in ``/tmp/work``;
4. sets resource limits (CPU seconds, address space, file size, open files,
   processes);
5. drops to an unprivileged user id of its own (no write access to anything owned
   by root; its process limit is not shared with any other sandbox running at the
   same time), and execs the interpreter in isolated mode (``-I``).

Without root it uses an unprivileged user namespace for steps 2–3 and remounts
every other mount read-only instead of changing user. If neither works
it exits with code 97 and a message, rather than run code unconfined.
"""

import ctypes
import json
import os
import pwd
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
NOBODY = 65534
# One user id per run (base + the launcher's pid, unique among running launchers), far above
# any account's: RLIMIT_NPROC counts a user's processes, so under a shared id (nobody) one
# sample's fork bomb would make every other sandbox running meanwhile fail to start.
RUN_UID_BASE = 1_900_000_000
UNCONFINED = 97


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _private_tmp(libc, limit_mb):
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            opts = f"size={limit_mb}m,mode=1777".encode()
            _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount tmpfs {path}")


def _isolate_as_root(libc, limits):
    _check(libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID), "unshare")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    _private_tmp(libc, limits["tmp_mb"])
    uid = _run_uid()
    os.makedirs("/tmp/work", exist_ok=True)
    try:
        os.chown("/tmp/work", uid, uid)
    except OSError:  # not mapped (a container's user namespace): the shared nobody, then
        uid = NOBODY
        os.chown("/tmp/work", uid, uid)
    os.chdir("/tmp/work")
    _set_limits(limits)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _run_uid():
    """This run's own user id (``nobody`` if an account has it)."""
    uid = RUN_UID_BASE + os.getpid()
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return uid
    return NOBODY


def _isolate_unprivileged(libc, limits):
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID), "unshare (user namespace)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for point in points:  # everything read-only (bind remount keeps the other flags)
        libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    _private_tmp(libc, limits["tmp_mb"])
    os.makedirs("/tmp/work", exist_ok=True)
    os.chdir("/tmp/work")
    _set_limits(limits)


def _set_limits(limits):
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = limits["file_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_as_pid_one(python):
    # unshare(CLONE_NEWPID) applies to children: fork, and the child is PID 1.
    child = os.fork()
    if child == 0:
        os.execve(python, [python, "-I", "-B", "-"], {"PATH": "/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8"})
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def main():
    limits = json.loads(sys.argv[1])
    libc = _libc()
    try:
        if os.geteuid() == 0:
            _isolate_as_root(libc, limits)
        else:
            _isolate_unprivileged(libc, limits)
    except OSError as e:
        sys.stderr.write(f"sandbox unavailable: {e}\n")
        os._exit(UNCONFINED)
    _run_as_pid_one(limits["python"])


if __name__ == "__main__":
    main()

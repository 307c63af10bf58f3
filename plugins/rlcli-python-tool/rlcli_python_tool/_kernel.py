# The kernel layers of the python tool's sandbox, applied by the child before the audit hook and
# the code: the OOM score, read-only mounts with a private size-limited folder, no capabilities,
# death with the parent, Landlock, and a seccomp filter. This text is put in front of ``_bootstrap.py`` and run with ``python -c``;
# importing the module (as the tests do) only defines functions. Pure ctypes on raw syscalls.
# Every step reports what it could not do instead of raising: the bootstrap decides, from the
# run's ``strict`` option, whether to refuse or to go on without that layer.
#
# Landlock constants (linux/landlock.h). Filesystem rights: EXECUTE 1<<0, WRITE_FILE 1<<1,
# READ_FILE 1<<2, READ_DIR 1<<3, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR (1<<6), MAKE_DIR, MAKE_REG,
# MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK (1<<11), MAKE_SYM (1<<12) - ABI 1; REFER 1<<13 - ABI 2;
# TRUNCATE 1<<14 - ABI 3; IOCTL_DEV 1<<15 - ABI 5. Network (ABI 4): BIND_TCP 1, CONNECT_TCP 2.
# Scopes (ABI 6): ABSTRACT_UNIX_SOCKET 1, SIGNAL 2.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # the same number on every architecture
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read files, list directories
_LL_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)  # the rights a rule on a file may carry
_LL_DEVICES = (1 << 6) | (1 << 11)  # making character and block devices: never, not even in the folder

# Syscalls the filter refuses (EPERM), by name: (x86_64 number, aarch64 number); None where the
# architecture has no such call.
_SC_DENY = {
    # other processes: tracing, their memory, their file descriptors, signals by pidfd
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424), "pidfd_getfd": (438, 438),
    "process_madvise": (440, 440), "process_mrelease": (448, 448), "tkill": (200, 130),
    "migrate_pages": (256, 238), "move_pages": (279, 239), "setrlimit": (160, 164),
    # new programs and processes (threads are allowed: see clone below)
    "execve": (59, 221), "execveat": (322, 281), "fork": (57, None), "vfork": (58, None),
    # memory the address-space limit does not count (shmem of memfd files), and network and shared
    # state outside the folder
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
    "socket": (41, 198), "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "inotify_init": (253, None), "inotify_init1": (294, 26),
    "fanotify_init": (300, 262),
    # kernel interfaces that bypass other checks or need privileges the code never has
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467), "reboot": (169, 142), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162), "syslog": (103, 116),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "iopl": (172, None), "ioperm": (173, None),
    "uselib": (134, None),
}
# Metadata changes, which Landlock does not cover: refused outright when the read-only mounts are
# missing (then they fail inside the folder too), left to the mounts when they are there.
_SC_METADATA = {
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "chown": (92, None), "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54),
    "utime": (132, None), "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "removexattr": (197, 14),
    "lremovexattr": (198, 15), "fremovexattr": (199, 16), "setxattrat": (463, 463), "removexattrat": (466, 466),
}
# Calls allowed only on the sandbox itself: name -> (numbers, argument that names the target)
_SC_SELF = {
    "kill": ((62, 129), 0), "tgkill": ((234, 131), 0), "rt_sigqueueinfo": ((129, 138), 0),
    "rt_tgsigqueueinfo": ((297, 240), 0), "sched_setparam": ((142, 118), 0),
    "sched_setscheduler": ((144, 119), 0), "sched_setaffinity": ((203, 122), 0), "sched_setattr": ((314, 274), 0),
}
_SC_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # table column, AUDIT_ARCH_*
_SC_SETPRIORITY, _SC_IOPRIO_SET, _SC_PRLIMIT = (141, 140), (251, 30), (302, 261)
_SC_CLONE, _SC_CLONE3, _SC_FCNTL, _SC_IOCTL = (56, 220), (435, 435), (72, 25), (16, 29)
_CLONE_THREAD = 0x00010000
_CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_F_SETOWN, _F_SETOWN_EX = 8, 15
_IOCTL_DENY = (0x8901, 0x8902, 0x5412)  # FIOSETOWN, SIOCSPGRP (SIGIO to another process), TIOCSTI


class _Bpf:
    """A classic BPF program for seccomp, written with labels that jumps may name before they are placed."""

    LD, JEQ, JGE, JSET, JA, RET = 0x20, 0x15, 0x35, 0x45, 0x05, 0x06
    ALLOW, EPERM, ENOSYS, KILL = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000

    def __init__(self):
        self.rows, self.labels = [], {}

    def emit(self, code, k=0, jt=0, jf=0):  # jt, jf (and k of JA) may name a label
        self.rows.append([code, jt, jf, k])

    def place(self, label):
        self.labels[label] = len(self.rows)

    def arg(self, i):  # the low 32 bits of argument i (little endian): what the kernel reads for an int
        self.emit(self.LD, 16 + 8 * i)

    def block(self, nr, conds, guard=None):
        """Calls to ``nr`` (whose argument ``guard[0]`` equals ``guard[1]``, if given) are allowed
        when every condition holds and refused otherwise; other calls go on to the next block.
        A condition is ("in", arg, values), ("word", offset, values) for a whole 32-bit word (the
        high half of an argument), ("set"/"clear", arg, mask), or ("never", 0, 0)."""
        end = "end%d" % len(self.rows)
        self.emit(self.LD, 0)
        self.emit(self.JEQ, nr, 0, end)
        if guard is not None:
            self.arg(guard[0])
            self.emit(self.JEQ, guard[1], 0, end)
        for n, (kind, where, value) in enumerate(conds):
            ok = "ok%d.%d" % (len(self.rows), n)
            if kind == "never":
                self.emit(self.RET, self.EPERM)
                continue
            if kind == "word":
                self.emit(self.LD, where)
            else:
                self.arg(where)
            if kind == "set":
                self.emit(self.JSET, value, ok, 0)
            elif kind == "clear":
                self.emit(self.JSET, value, 0, ok)
            else:
                for v in value:
                    self.emit(self.JEQ, v, ok, 0)
            self.emit(self.RET, self.EPERM)
            self.place(ok)
        self.emit(self.RET, self.ALLOW)
        self.place(end)

    def program(self):
        """The rows as (code, jt, jf, k), labels turned into forward offsets."""
        for i, row in enumerate(self.rows):
            for j in (1, 2, 3):
                if isinstance(row[j], str):
                    row[j] = self.labels[row[j]] - i - 1
            if not (0 <= row[1] <= 255 and 0 <= row[2] <= 255):
                raise ValueError("seccomp program: jump out of range")
        return [tuple(r) for r in self.rows]


def _sc_program(arch, mypid, metadata):
    """The seccomp filter as (code, jt, jf, k) rows, or None on an architecture without a table.

    Refused (EPERM): the calls in ``_SC_DENY`` (and ``_SC_METADATA`` when ``metadata``); new
    processes (``clone`` without ``CLONE_THREAD`` or with a namespace flag; ``clone3`` answers
    ENOSYS so that the C library falls back to ``clone``); signals, priority, scheduling and
    resource limits aimed at any process but this one (its pid, 0, or its own group); F_SETOWN of
    another process. A system call of another ABI (x32, i386) kills the process.
    """
    if arch not in _SC_ARCH:
        return None
    col, audit_arch = _SC_ARCH[arch]
    me, group = mypid & 0xFFFFFFFF, (-mypid) & 0xFFFFFFFF
    b = _Bpf()
    b.emit(b.LD, 4)
    b.emit(b.JEQ, audit_arch, 1, 0)
    b.emit(b.RET, b.KILL)
    b.emit(b.LD, 0)
    if arch == "x86_64":
        b.emit(b.JGE, 0x40000000, "deny", 0)  # x32 system calls
    denied = list(_SC_DENY.values()) + (list(_SC_METADATA.values()) if metadata else [])
    for nums in denied:
        if nums[col] is not None:
            b.emit(b.JEQ, nums[col], "deny", 0)
    b.emit(b.JEQ, _SC_CLONE3[col], "nosys", 0)
    b.emit(b.JA, "checks")  # an unconditional jump: its offset is k, 32 bits wide
    b.place("deny")
    b.emit(b.RET, b.EPERM)
    b.place("nosys")
    b.emit(b.RET, b.ENOSYS)
    b.place("checks")
    for nums, pid_arg in _SC_SELF.values():
        b.block(nums[col], [("in", pid_arg, (0, me, group))])
    b.block(_SC_SETPRIORITY[col], [("in", 0, (0,)), ("in", 1, (0, me))])  # PRIO_PROCESS, this process
    b.block(_SC_IOPRIO_SET[col], [("in", 0, (1,)), ("in", 1, (0, me))])  # IOPRIO_WHO_PROCESS, this process
    b.block(_SC_PRLIMIT[col], [("in", 0, (0, me)), ("in", 2, (0,)), ("word", 16 + 8 * 2 + 4, (0,))])  # read only
    b.block(_SC_CLONE[col], [("set", 0, _CLONE_THREAD), ("clear", 0, _CLONE_NEW_NAMESPACES)])
    b.block(_SC_FCNTL[col], [("in", 2, (0, me, group))], guard=(1, _F_SETOWN))
    b.block(_SC_FCNTL[col], [("never", 0, 0)], guard=(1, _F_SETOWN_EX))
    for request in _IOCTL_DENY:
        b.block(_SC_IOCTL[col], [("never", 0, 0)], guard=(1, request))
    b.emit(b.RET, b.ALLOW)
    return b.program()


def _kernel_layers(root, read_paths, mounts, disk_bytes, inodes, without=(), parent=None):
    """Apply every layer this machine offers, in order; returns ({layer: value}, [problems]).

    ``mounts``: the process is alone in fresh user and mount namespaces (``unshare``), so it may
    make every mount read-only and put a tmpfs of ``disk_bytes`` over ``root``. ``without``:
    layers to leave out ("mounts", "landlock", "seccomp"), for tests of what holds without them.
    ``parent``: the pid of the process that started the sandbox; the child dies with it
    (``PR_SET_PDEATHSIG``), and exits at once if it is already gone.
    """
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    L = ctypes.c_long
    problems = []

    def failed(what, why=None):
        e = ctypes.get_errno()
        problems.append("%s: %s" % (what, why or "%s (errno %d)" % (os.strerror(e), e)))
        return False

    _oom_first(os, problems)  # before the mounts are read-only: under memory pressure, this process dies first
    layers = {"mounts": False, "capabilities": False, "landlock": 0, "seccomp": False}
    if mounts and "mounts" not in without:
        layers["mounts"] = _readonly_mounts(ctypes, libc, L, root, disk_bytes, inodes, failed)
    # no capabilities: not even those of the user namespace (as root, without one: none at all)
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
    layers["capabilities"] = libc.capset(header, data) == 0 or failed("dropping capabilities")
    # SIGKILL when the parent dies (set after capset, whose credential change could reset it;
    # unshare execs python, so this is the process that runs the code). The parent may have died
    # before: then this process was re-parented and must not go on.
    if libc.prctl(1, L(9), L(0), L(0), L(0)) != 0:  # PR_SET_PDEATHSIG, SIGKILL
        failed("parent-death signal")
    if parent is not None and os.getppid() != parent:
        os.write(2, ("[sandbox] cannot run: the parent is pid %d, not the process that started the sandbox (%d): "
                     "that one is gone\n" % (os.getppid(), parent)).encode())
        os._exit(70)
    if libc.prctl(38, L(1), L(0), L(0), L(0)) != 0:  # PR_SET_NO_NEW_PRIVS: Landlock and seccomp need it
        failed("no_new_privs")
        return layers, problems
    if "landlock" not in without:
        layers["landlock"] = _landlock(ctypes, libc, L, root, read_paths, failed)
    if "seccomp" not in without:
        layers["seccomp"] = _seccomp(ctypes, libc, L, not layers["mounts"], failed)
    return layers, problems


def _oom_first(os, problems):
    """``oom_score_adj`` 1000 (raising it needs no privilege): the kernel's OOM killer picks this
    process before the trainer, also for memory it does not charge to the address-space limit."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
    except OSError as exc:
        problems.append("oom_score_adj: %s" % exc)


def _readonly_mounts(ctypes, libc, L, root, disk_bytes, inodes, failed):
    """Every mount read-only (recursively, one ``mount_setattr``: Linux 5.12+), then a fresh
    tmpfs of ``disk_bytes`` over the folder, which becomes the working directory."""
    import os

    attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr {attr_set = MOUNT_ATTR_RDONLY, ...}
    if libc.syscall(L(442), L(-100), b"/", L(0x8000), ctypes.byref(attr), L(32)) != 0:  # AT_RECURSIVE
        return failed("read-only mounts (mount_setattr)")
    opts = ("size=%d,nr_inodes=%d,mode=0700" % (disk_bytes, inodes)).encode()
    if libc.mount(b"tmpfs", root.encode(), b"tmpfs", L(2 | 4), opts) != 0:  # MS_NOSUID | MS_NODEV
        return failed("a private tmpfs for the folder")
    os.chdir(root)  # the old working directory is the folder under the new mount
    return True


def _landlock(ctypes, libc, L, root, read_paths, failed):
    """Landlock: read-write in the folder, read-only in ``read_paths``, nothing elsewhere; TCP
    bind/connect denied (ABI 4); signals and abstract unix sockets only within the sandbox
    (ABI 6). Returns the ABI in force (0: none)."""
    import os

    abi = libc.syscall(L(_LL_CREATE), None, L(0), L(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        failed("Landlock")
        return 0
    fs = (1 << 13) - 1 | ((1 << 13) if abi >= 2 else 0) | ((1 << 14) if abi >= 3 else 0) | ((1 << 15) if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    ruleset = libc.syscall(L(_LL_CREATE), ctypes.byref(attr), L(24 if abi >= 6 else 16 if abi >= 4 else 8), L(0))
    if ruleset < 0:
        failed("Landlock ruleset")
        return 0

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def allow(path, access):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return True  # a path this machine does not have
        try:
            if not os.path.isdir(path):
                access &= _LL_FILE_RIGHTS
            rule = PathBeneath(access & fs, fd)
            return libc.syscall(L(_LL_ADD_RULE), L(ruleset), L(1), ctypes.byref(rule), L(0)) == 0
        finally:
            os.close(fd)

    try:
        if not allow(root, fs & ~_LL_DEVICES):
            failed("Landlock rule for the folder")
            return 0
        for p in read_paths:
            allow(p, _LL_READ)
        allow("/dev/null", (1 << 1) | (1 << 2) | (1 << 14))
        if libc.syscall(L(_LL_RESTRICT), L(ruleset), L(0)) != 0:
            failed("Landlock restrict_self")
            return 0
    finally:
        os.close(ruleset)
    return abi


def _seccomp(ctypes, libc, L, metadata, failed):
    """Install the filter of :func:`_sc_program` (``prctl(PR_SET_SECCOMP)``); returns whether it holds."""
    import os
    import sys

    rows = _sc_program(os.uname().machine, os.getpid(), metadata) if sys.byteorder == "little" else None
    if rows is None:
        return failed("seccomp", "no system call table for %s (%s endian)" % (os.uname().machine, sys.byteorder))

    class Row(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Row))]

    table = (Row * len(rows))(*[Row(*r) for r in rows])
    prog = Prog(len(rows), table)
    if libc.prctl(22, L(2), ctypes.byref(prog), L(0), L(0)) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        return failed("seccomp filter")
    return True


_NOT_A_BOUNDARY = ("the in-process audit hook, which is not a security boundary (code that corrupts the "
                   "interpreter - the ctypes types loaded to set up these layers stay reachable - switches it off)")


def _boundary_missing(layers):
    """The missing layers that hold against hostile code (``strict: boundary``): Landlock, which
    confines every file the code opens, and the seccomp filter, which refuses new processes,
    programs, sockets, memfd files and signals to others. One line each, as :func:`_missing_layers`."""
    out = []
    if layers.get("landlock", 0) < 1:
        out.append("no Landlock (Linux 5.13+, `landlock` in the LSM list): hostile code could read every file "
                   "this user can read")
    if not layers.get("seccomp"):
        out.append("no seccomp filter (x86_64 or aarch64 Linux): hostile code could start programs, open "
                   "sockets and signal other processes")
    return out


def _missing_layers(layers):
    """What does not hold without each missing layer, one line each (empty: all are in force).

    Each line names what hostile code can then do: with a layer missing, what it enforced rests
    on the audit hook alone, and the hook does not hold against code written to get past it.
    """
    out = []
    mounts = layers.get("mounts")
    if not mounts:
        out.append("no user and mount namespaces (unshare, Linux 5.12+): no network namespace, the rest of "
                   "the filesystem is not read-only, the folder has no size limit (only RLIMIT_FSIZE per file) "
                   "and chmod/chown/utime/xattr calls are refused everywhere")
    abi = layers.get("landlock", 0)
    if abi < 1:
        out.append("no Landlock (Linux 5.13+, `landlock` in the LSM list): reads outside the folder%s are stopped "
                   "only by %s - hostile code can read every file this user can read%s (sqlite3 and dbm are "
                   "refused)" % ("" if mounts else " and writes", _NOT_A_BOUNDARY,
                                 "" if mounts else " and write wherever this user can"))
    elif abi < 6:
        out.append("Landlock ABI %d < 6 (Linux 6.12+): signals and abstract unix sockets are confined by the "
                   "seccomp filter only%s" % (abi, ", truncate() outside rests on the mounts" if abi < 3 else ""))
    if not layers.get("seccomp"):
        out.append("no seccomp filter (x86_64 or aarch64 Linux): changes to the priority, scheduling and limits "
                   "of other processes, pidfd signals, new processes and programs, memfd files and sockets are "
                   "stopped only by %s" % _NOT_A_BOUNDARY)
    if not layers.get("capabilities"):
        out.append("capabilities could not be dropped")
    return out

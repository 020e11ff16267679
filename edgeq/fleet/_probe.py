"""What a device has: sent as ``python -c`` source, so it must stand alone (stdlib only,
Python 3.7+) and work before edgeq is installed there. Prints one JSON object.

argv[1]: the work directory (free disk is measured there, or at its nearest parent). What
follows prepares a site install in the same Python start-up (edgeq.fleet.bootstrap):
``--remove DIR`` deletes a half-unpacked earlier try before anything is looked up,
``--mkdir DIR`` makes a folder, ``--list DIR`` adds {DIR: {file name: size}} of what each
listed DIR holds.
"""

import glob
import json
import os
import platform
import sys


def prepare(args):
    """Act on --remove/--mkdir; return the folders --list names."""
    import importlib
    import shutil

    listing = []
    for flag, path in zip(args[::2], args[1::2]):
        if flag == "--remove":
            shutil.rmtree(os.path.expanduser(path), ignore_errors=True)
        elif flag == "--mkdir":
            os.makedirs(os.path.expanduser(path), exist_ok=True)
        elif flag == "--list":
            listing.append(path)
    importlib.invalidate_caches()  # a removed folder on sys.path must not be found from a cache
    return listing


def listed(path):
    folder = os.path.expanduser(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    return {n: os.path.getsize(os.path.join(folder, n)) for n in names if os.path.isfile(os.path.join(folder, n))}


LISTING = prepare(sys.argv[2:])


def version(dist):
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return None
    try:
        return metadata.version(dist)
    except Exception:
        return None


def importable(name):
    try:
        import importlib.util

        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def os_name():
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def free_bytes(path):
    path = os.path.expanduser(path)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
        return st.f_bavail * st.f_frsize
    except (OSError, AttributeError):
        return None


def edgetpu():
    libs = []
    for pattern in ("/usr/lib/*/libedgetpu.so.1*", "/usr/lib/libedgetpu.so.1*", "/usr/local/lib/libedgetpu.so.1*"):
        libs += glob.glob(pattern)
    devices = glob.glob("/dev/apex_*")
    for vendor_file in glob.glob("/sys/bus/usb/devices/*/idVendor"):
        try:
            with open(vendor_file) as fh:
                vendor = fh.read().strip()
            with open(vendor_file.replace("idVendor", "idProduct")) as fh:
                product = fh.read().strip()
        except OSError:
            continue
        if (vendor, product) in (("1a6e", "089a"), ("18d1", "9302")):
            devices.append(f"usb:{vendor}:{product}")
    return {"library": libs[0] if libs else None, "devices": devices}


def runtime():
    for module, dist in (("ai_edge_litert", "ai-edge-litert"), ("tflite_runtime", "tflite-runtime")):
        if importable(module):
            return module, version(dist)
    return None, None


def edgeq_version():
    if not importable("edgeq"):
        return None
    try:
        import edgeq

        return edgeq.__version__
    except Exception:
        return None


name, rt_version = runtime()
print(
    json.dumps(
        {
            "machine": platform.machine(),
            "system": platform.system(),
            "os": os_name(),
            "python": platform.python_version(),
            "python_tag": "{}.{}".format(*sys.version_info[:2]),
            "executable": sys.executable,
            "glibc": "-".join(platform.libc_ver()),
            "numpy": version("numpy"),
            "click": version("click"),
            "runtime": name,
            "runtime_version": rt_version,
            "edgeq": edgeq_version(),
            "free_bytes": free_bytes(sys.argv[1] if len(sys.argv) > 1 else "~"),
            "edgetpu": edgetpu(),
            "pip": importable("pip"),
            "venv": importable("ensurepip") and importable("venv"),
            "listed": {path: listed(path) for path in LISTING},
        }
    )
)

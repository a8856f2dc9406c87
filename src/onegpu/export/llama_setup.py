"""llama.cpp from PyPI: `llama-cpp-python`'s source distribution vendors llama.cpp with its
converter (convert_hf_to_gguf.py, its conversion/ package, gguf-py), and its binding exposes the
quantizer and the runtime. The converter comes from the sdist (downloaded once by pip into the
onegpu cache); the binding is a wheel built once from the same sdist with the flags below
(scripts/build_llama_cpp.sh) and installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from onegpu.errors import UnavailableError
from onegpu.paths import cache_dir

VERSION = "0.3.36"
# A llama.cpp built for the building CPU (GGML_NATIVE, the default) crashes on the first decode of a
# quantized GGUF on Intel Xeons with AVX-512 and AMX (f16 decodes); built for AVX2 it decodes every
# type. Pinned here and in scripts/build_llama_cpp.sh.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
    "-DGGML_AMX_INT8=OFF"
)
BUILD_HINT = "bash scripts/build_llama_cpp.sh (builds it once with the pinned flags)"


def root() -> Path:
    """Where the sdist, the wheel and the converter are kept (the build script's folder)."""
    own = os.environ.get("ONEGPU_LLAMA_CPP_DIR")
    return Path(own).expanduser() if own else cache_dir() / "llama-cpp" / VERSION


def require_binding():
    """The llama_cpp module, or one error saying how to get it."""
    try:
        import llama_cpp
    except ImportError:
        raise UnavailableError(
            "--format gguf needs llama-cpp-python (llama.cpp's runtime and quantizer), which "
            "is not installed.",
            hint=f"{BUILD_HINT}; or pip install 'onegpu[export]', a native build that crashes on "
            "quantized types on some AVX-512 CPUs",
        ) from None
    if llama_cpp.__version__ != VERSION:
        raise UnavailableError(
            f"llama-cpp-python {llama_cpp.__version__} is installed; the export is pinned to "
            f"{VERSION} (its converter and runtime are checked together).",
            hint=BUILD_HINT,
        )
    return llama_cpp


def converter_dir(say: Callable[[str], None] = print) -> Path:
    """llama.cpp's source folder from the sdist: convert_hf_to_gguf.py, conversion/, gguf-py/.
    Downloaded by pip (no build) and unpacked into the cache the first time."""
    dest = root() / "llama.cpp"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    sdist = fetch_sdist(say)
    say(f"unpacking llama.cpp's converter from {sdist.name}")
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    tmp = dest.with_name("llama.cpp.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix)
            and m.name[len(prefix) :].split("/")[0]
            in ("convert_hf_to_gguf.py", "conversion", "gguf-py")
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(tmp, members=members, filter="data")
    tmp.replace(dest)
    return dest


def fetch_sdist(say: Callable[[str], None] = print) -> Path:
    folder = root() / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    say(f"downloading llama-cpp-python {VERSION}'s source (75 MB, once) into {folder}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    done = subprocess.run(
        [*cmd, f"llama-cpp-python=={VERSION}", "-d", str(folder)], capture_output=True, text=True
    )
    found = sorted(folder.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if done.returncode or not found:
        raise UnavailableError(
            f"could not download llama-cpp-python {VERSION}'s source: "
            f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}",
            hint="check the connection to PyPI, or place the .tar.gz in " + str(folder),
        )
    return found[0]


def supported_architectures(llama_dir: Path) -> set[str]:
    """The transformers architectures llama.cpp's converter registers a text model class for (its
    own @ModelBase.register declarations, read without importing it)."""
    names: set[str] = set()
    for path in (llama_dir / "conversion").glob("*.py"):
        for args in re.findall(r"@ModelBase\.register\(([^)]*)\)", path.read_text("utf-8")):
            if "MMPROJ" not in args:
                names.update(re.findall(r"\"([A-Za-z0-9_]+)\"", args))
    return names

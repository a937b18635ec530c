"""Builds the Python package `ferry` for pip: `pip install --no-build-isolation .` (README.md, "Python").

setuptools copies the Python modules (python/ferry) and hands the compiled parts to CMake: it configures
build/pip (Release, no tests), builds libferry, the extension ferry._ferry and the ferry program, and
`cmake --install --component python` puts them into the package with RUNPATHs relative to themselves
(python/CMakeLists.txt). CMAKE_ARGS adds configure options (e.g. "-DFERRY_WITH_CUDA=OFF").

FERRY_CMAKE_BUILD_DIR=DIR takes the package from an already-configured ferry build instead (the test suite's
own build, so that the test does not compile ferry a second time); that build must be for this Python.
"""
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
GIVEN_BUILD = os.environ.get("FERRY_CMAKE_BUILD_DIR")
CMAKE_BUILD = Path(GIVEN_BUILD).resolve() if GIVEN_BUILD else ROOT / "build" / "pip"
# setuptools' own work (build_lib, the wheel's tree, egg-info) beside CMake's, not in the source tree.
SETUPTOOLS_WORK = CMAKE_BUILD / "setuptools"


def project_version():
    for line in (ROOT / "CMakeLists.txt").read_text().splitlines():
        if line.startswith("project(ferry VERSION "):
            return line.split()[2]
    raise SetupError("CMakeLists.txt: no 'project(ferry VERSION x.y.z' line")


def run(*cmd):
    print("+", shlex.join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


class CMakeBuild(build_ext):
    """The one extension is built by CMake, together with the library and the program it needs."""

    def run(self):
        if self.inplace:
            raise SetupError("ferry: editable installs are not supported; for development use the CMake build "
                             "(PYTHONPATH=build/python, README.md)")
        cmake = shutil.which("cmake") or "cmake"
        if not GIVEN_BUILD:
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            run(cmake, "-S", ROOT, "-B", CMAKE_BUILD, *generator, "-DCMAKE_BUILD_TYPE=Release",
                "-DFERRY_BUILD_TESTS=OFF", "-DFERRY_PYTHON_REQUIRED=ON", f"-DPython3_EXECUTABLE={sys.executable}",
                *shlex.split(os.environ.get("CMAKE_ARGS", "")))
        run(cmake, "--build", CMAKE_BUILD, "--target", "_ferry", "ferry_cli", "ferry_preload")
        package = Path(self.build_lib).resolve() / "ferry"
        # What an earlier install put here (another Python's extension, another soname) must not ship.
        for old in [*package.glob("_ferry*.so"), *package.glob("libferry.so*"), *package.glob("libferry_preload.so")]:
            old.unlink()
        shutil.rmtree(package / "bin", ignore_errors=True)
        run(cmake, "--install", CMAKE_BUILD, "--component", "python", "--prefix", package.parent)
        extension = package / ("_ferry" + sysconfig.get_config_var("EXT_SUFFIX"))
        if not extension.is_file():
            found = ", ".join(p.name for p in package.glob("_ferry*.so")) or "none"
            raise SetupError(f"{CMAKE_BUILD} has no ferry._ferry for this Python ({sys.executable}: wants "
                             f"{extension.name}, found {found}); configure it with "
                             f"-DPython3_EXECUTABLE={sys.executable}")


if GIVEN_BUILD and not (CMAKE_BUILD / "CMakeCache.txt").is_file():
    raise SetupError(f"FERRY_CMAKE_BUILD_DIR={GIVEN_BUILD}: not a configured CMake build directory")
SETUPTOOLS_WORK.mkdir(parents=True, exist_ok=True)
setup(
    version=project_version(),
    packages=["ferry"],
    package_dir={"ferry": "python/ferry"},
    ext_modules=[Extension("ferry._ferry", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": str(SETUPTOOLS_WORK)}, "egg_info": {"egg_base": str(SETUPTOOLS_WORK)}},
)

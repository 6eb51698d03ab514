# Sourced by the GPU machine's helper scripts (debug.sh, ab.sh), from the repository root: unpacks the carried
# binaries if they are not there yet, puts the image's cuBLAS pip wheels on the loader path (the prefill GEMMs)
# and points the test binaries at tests/ (NEXTN_TESTS_DIR).
[[ -x bench/gpu/bin/nextn-bench ]] || tar -C bench/gpu -xzf bench/gpu/bin.tar.gz
WHEEL_LIBS="$(python3 -c '
import glob, os, site
d = set()
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(p, "nvidia", "**", "libcublas*.so*"), recursive=True): d.add(os.path.dirname(f))
print(":".join(sorted(d)))' 2> /dev/null)"
export LD_LIBRARY_PATH="$WHEEL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NEXTN_TESTS_DIR="$PWD/tests"

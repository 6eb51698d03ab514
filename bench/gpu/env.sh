# Sourced by the GPU machine's scripts (run.sh, replay.sh, debug.sh, ab.sh), from the repository root: unpacks the
# carried binaries when the tarball differs from the one last unpacked (a warm machine keeps bench/gpu/bin/ between
# calls: a rebuilt tarball must not run the old binaries), puts the image's cuBLAS pip wheels on the loader path
# (the prefill GEMMs) and points the test binaries at tests/ (NEXTN_TESTS_DIR) and kernels/ (NEXTN_KERNELS_DIR).
# tar's errors go to $NEXTN_UNPACK_ERR (default stderr).
if [[ -f bench/gpu/bin.tar.gz ]]; then
    tarball_sum="$(md5sum < bench/gpu/bin.tar.gz)"
    if [[ "$(cat bench/gpu/bin/.tarball.md5 2> /dev/null)" != "$tarball_sum" ]]; then
        rm -rf bench/gpu/bin
        tar -C bench/gpu -xzf bench/gpu/bin.tar.gz 2>> "${NEXTN_UNPACK_ERR:-/dev/stderr}" \
            && printf '%s' "$tarball_sum" > bench/gpu/bin/.tarball.md5
    fi
fi
WHEEL_LIBS="$(timeout 10 python3 -c '
import glob, os, site
d = set()
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(p, "nvidia", "**", "libcublas*.so*"), recursive=True): d.add(os.path.dirname(f))
print(":".join(sorted(d)))' 2> /dev/null)"
[[ -n "$WHEEL_LIBS" ]] && export LD_LIBRARY_PATH="$WHEEL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NEXTN_TESTS_DIR="$PWD/tests" NEXTN_KERNELS_DIR="$PWD/kernels"

# Sourced by scripts/lab/gpu_report.sh and scripts/lab/gpu_screen.sh (which set $python): puts the wheels
# carried in .whl/ (packages a lent GPU machine lacks, e.g. hydra-core or datasets) on PYTHONPATH
# ahead of the working tree, then checks that the validation split loads. Does nothing when .whl/
# holds no wheels.
#
# - The folder is emptied first: a warm machine keeps /tmp between calls, and a stale package left
#   there by an earlier call would shadow the carried one.
# - It is named site-packages because datasets hashes its tables with dill, which pickles a module
#   living anywhere else by value (and there fails on pyarrow's types).
# - If the carried wheels' pyarrow cannot load the data, the machine's own pyarrow is used.
gpu_data_loads() {
    $python -c "from transformer.data import DataConfig, load_split; load_split(DataConfig(), 'val')"
}

gpu_use_carried_wheels() {
    compgen -G ".whl/*.whl" >/dev/null || return 0
    local site=/tmp/wheels/site-packages
    rm -rf "$site"
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl ||
        return 1
    export PYTHONPATH=$site:$PWD
    gpu_data_loads || { echo "the carried pyarrow failed; using the machine's own"; rm -rf "$site"/pyarrow*; }
}

#!/bin/bash
# pyinject.sh PID FILE: run FILE's Python code inside process PID (gdb, libpython symbols by offset)
P=$1; F=$2
LIB=/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
BASE=$(grep -m1 "libpython3.11.so.1.0" /proc/$P/maps | cut -d- -f1)
off() { nm -D $LIB | awk -v s="$1" '$3==s {print $1}'; }
E=$(printf "0x%x" $((0x$BASE + 0x$(off PyGILState_Ensure))))
R=$(printf "0x%x" $((0x$BASE + 0x$(off PyRun_SimpleString))))
L=$(printf "0x%x" $((0x$BASE + 0x$(off PyGILState_Release))))
timeout 120 gdb -p $P -batch -ex "set \$g = ((int (*)(void))$E)()" \
  -ex "call ((int (*)(const char *))$R)(\"exec(open('$F').read())\")" \
  -ex "call ((void (*)(int))$L)(\$g)" 2>&1 | grep -E '^\$|rror'

#!/usr/bin/env bash
# sysc.sh BIN LABEL: syscalls of relay, agent, upstream per request (perf stat over 5 s of a 12 s run)
bin=$1; l=$2; o=/work/bench/sysc/$l; rm -rf $o; mkdir -p $o
($bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss requests --mix get=1 --paths tether --duration 10s --warmup 2s > $o/lt.log 2>&1 &)
for i in $(seq 100); do [ -s $o/work/relay-wss/relay.pid ] && [ -s $o/work/agent-wss/agent-loadtest.pid ] && break; sleep 0.2; done
sleep 5
A=$(cat $o/work/agent-wss/agent-loadtest.pid); U=$(cat $o/work/upstream/upstream.pid)
perf stat -x, -e 'syscalls:sys_enter_writev,syscalls:sys_enter_write,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_read,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,context-switches' -p $A -o $o/agent.stat -- sleep 5 &
perf stat -x, -e 'syscalls:sys_enter_writev,syscalls:sys_enter_write,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_read,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait' -p $U -o $o/up.stat -- sleep 5
wait; sleep 8
rps=$(python3 -c "import json;print(json.load(open('$o/requests.json'))['runs'][0]['requests_per_sec'])")
echo "$l rps $rps"; for f in agent up; do echo -n "  $f: "; awk -F, -v r=$rps '/^[0-9]/{printf "%s %.2f  ", $3, $1/(r*5)}' $o/$f.stat; echo; done

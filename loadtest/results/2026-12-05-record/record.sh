set -x
cd /work/main; LT=/work/bench/binM25/tether-loadtest; R=loadtest/results/2026-12-05-record
date
$LT --out $R/main28-gets --no-progress --transport wss,quic requests --mix get=1 --paths direct,tether,rathole,haproxy > $R/main28-gets.log 2>&1
$LT --out $R/main28-gets-c1 --no-progress --transport wss,quic requests --mix get=1 --concurrency 1 --paths direct,tether,rathole,haproxy > $R/main28-gets-c1.log 2>&1
for i in 1 2 3; do $LT --out $R/main28-mix-$i --no-progress --transport wss,quic requests --paths direct,tether,rathole,haproxy > $R/main28-mix-$i.log 2>&1; done
$LT --out $R/main28-bulk --no-progress --transport wss,quic bulk > $R/main28-bulk.log 2>&1
date
$LT --out $R/main28-gets-2 --no-progress --transport wss,quic requests --mix get=1 --paths direct,tether,rathole,haproxy > $R/main28-gets-2.log 2>&1
$LT --out $R/main28-hol-wss --no-progress --transport wss hol > $R/main28-hol-wss.log 2>&1
date
$LT --out $R/main28-hol-quic --no-progress --transport quic hol > $R/main28-hol-quic.log 2>&1
$LT --out $R/main28-tunnels --no-progress tunnels --count 10000 --heartbeat-interval 30s > $R/main28-tunnels.log 2>&1
$LT --out $R/main28-reconnect --no-progress reconnect --count 10000 > $R/main28-reconnect.log 2>&1
date
for i in 1 2; do for b in binS binM25stale binM25; do /work/bench/$b/tether-loadtest --out /work/bench/runs/hol28/$b-$i --no-progress --work-dir /work/bench/runs/hol28/$b-$i/work --transport wss hol > /work/bench/runs/hol28/$b-$i.log 2>&1; done; done
for i in 1 2; do for b in binS binM25stale binM25; do /work/bench/$b/tether-loadtest --out /work/bench/runs/idle28/$b-$i --no-progress --work-dir /work/bench/runs/idle28/$b-$i/work tunnels --count 200 > /work/bench/runs/idle28/$b-$i.log 2>&1; done; done
date

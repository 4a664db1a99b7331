set -x
cd /work/main; LT=/work/bench/binV/tether-loadtest; R=loadtest/results/2026-12-05-encode
date
$LT --out $R/main26-gets --no-progress --transport wss,quic requests --mix get=1 --paths direct,tether,rathole,haproxy > $R/main26-gets.log 2>&1
$LT --out $R/main26-gets-c1 --no-progress --transport wss,quic requests --mix get=1 --concurrency 1 --paths direct,tether,rathole,haproxy > $R/main26-gets-c1.log 2>&1
for i in 1 2 3; do $LT --out $R/main26-mix-$i --no-progress --transport wss,quic requests --paths direct,tether,rathole,haproxy > $R/main26-mix-$i.log 2>&1; done
$LT --out $R/main26-bulk --no-progress --transport wss,quic bulk > $R/main26-bulk.log 2>&1
date

import sys,subprocess,re
# callers.py FILE FUNCSUBSTR : top callers of the function (inclusive cost from each)
f,fn=sys.argv[1],sys.argv[2]
out=subprocess.run(['callgrind_annotate','--tree=caller','--threshold=100',f],capture_output=True,text=True).stdout.splitlines()
block=[]
for line in out:
    if not line.strip(): block=[]; continue
    if '*  ' in line and fn in line.split('*',1)[1]:
        rows=[]
        for b in block:
            m=re.match(r'\s*([\d,]+) .*?<\s+(.*)$',b)
            if m: rows.append((int(m.group(1).replace(',','')),m.group(2)))
        for c,n in sorted(rows,reverse=True)[:8]: print(f'{c:>14,} {n[:220]}')
        print('----', line.strip()[:150])
    else: block.append(line)

import sys,subprocess,re
# calls.py FILE FUNC: total calls into FUNC, and the top callers by call count
f,fn=sys.argv[1],sys.argv[2]
out=subprocess.run(['callgrind_annotate','--tree=caller','--threshold=100',f],capture_output=True,text=True).stdout.splitlines()
block=[]
for line in out:
    if not line.strip(): block=[]; continue
    if '*  ' in line and line.rstrip().split('*',1)[1].split(':')[-1].split(' [')[0].strip()==fn:
        rows=[]
        for b in block:
            m=re.match(r'\s*([\d,]+) .*?<\s+(.*?)\(([\d,]+)x\)',b)
            if m: rows.append((int(m.group(3).replace(',','')),m.group(2)))
        print(fn,'calls',sum(c for c,_ in rows))
        for c,n in sorted(rows,reverse=True)[:int(sys.argv[3]) if len(sys.argv)>3 else 25]: print(f'{c:>10,} {n[:200]}')
    else: block.append(line)

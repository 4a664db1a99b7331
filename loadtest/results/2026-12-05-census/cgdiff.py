import sys,subprocess,glob,json,re,collections
# cgdiff.py LABELDIR PROC [inclusive] : per-GET Ir by function, slope d4->d12
lab,proc=sys.argv[1],sys.argv[2]; incl=len(sys.argv)>3 and sys.argv[3]=="incl"
def costs(d):
    c=collections.Counter()
    for f in glob.glob(f'{lab}/d{d}/cg.{proc}.*'):
        out=subprocess.run(['callgrind_annotate','--threshold=100',f'--inclusive={"yes" if incl else "no"}',f],capture_output=True,text=True).stdout
        sec=0
        for line in out.splitlines():
            if 'file:function' in line: sec=1; continue
            if sec==1 and line.startswith('----'): continue
            if sec==1 and not line.strip(): 
                if c: sec=2
                continue
            if sec!=1: continue
            m=re.match(r'\s*([\d,]+) \([^)]*\)\s+(\S.*)$',line)
            if m and 'PROGRAM TOTALS' not in line:
                name=m.group(2)
                name=re.sub(r'^.*?:(?=[^/]*$)','',name.split(' [')[0]) if ':' in name else name
                c[name]+=int(m.group(1).replace(',',''))
    return c
n={d:json.load(open(f'{lab}/d{d}/requests.json'))['runs'][0]['requests'] for d in (4,12)}
a,b=costs(4),costs(12); dn=n[12]-n[4]
rows=sorted(((b[k]-a.get(k,0))/dn,k) for k in b)
tot=sum(r for r,_ in rows) if not incl else None
for r,k in reversed(rows[-int(sys.argv[4]) if len(sys.argv)>4 else -60:]):
    print(f'{r:9.0f} {k[:150]}')
if tot: print('total self', round(tot))

"""The page's text machinery, free of torch: texts stored once, diffs as ``difflib`` opcodes,
the CSS and the script that renders texts and side-by-side diffs on first open, and a page of
one diff (what a failing golden test writes: the pytest plugin imports this module on failure,
so it must not pull in torch).
"""

from __future__ import annotations

import difflib
import json
from html import escape

__all__ = ["PAGE_CSS", "PAGE_JS", "TextStore", "build_diff_page", "diff_opcodes", "payload_script"]


def diff_opcodes(a: str, b: str) -> list[list]:
    """``difflib`` opcodes over lines, without the ``equal`` ones' bulk: ``[tag, i1, i2, j1, j2]``
    with tags shortened to ``e`` / ``r`` / ``d`` / ``i``."""
    al, bl = a.splitlines(), b.splitlines()
    sm = difflib.SequenceMatcher(None, al, bl, autojunk=False)
    return [[tag[0], i1, i2, j1, j2] for tag, i1, i2, j1, j2 in sm.get_opcodes()]


class TextStore:
    """Distinct texts, stored once (stages often leave a graph unchanged)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if text not in self._index:
            self._index[text] = len(self.items)
            self.items.append(text)
        return self._index[text]


def build_diff_page(a: str, b: str, *, title: str, a_name: str = "golden file", b_name: str = "this run",
                    note: str = "") -> str:
    """A page with one side-by-side diff of ``a`` and ``b``, open (what a failing golden test
    writes): the page's own diff renderer, unchanged runs folded."""
    texts = TextStore()
    ops = diff_opcodes(a, b)
    changed = sum(max(i2 - i1, j2 - j1) for t, i1, i2, j1, j2 in ops if t != "e")
    diffs = [{"a": texts.add(a), "b": texts.add(b), "a_name": a_name, "b_name": b_name, "ops": ops}]
    summary = f"{a_name} vs {b_name}: {changed} lines differ"
    return "".join([
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>{escape(title)}</title><style>{PAGE_CSS}</style></head><body>",
        f"<header><h1>{escape(title)}</h1><p>{escape(note)}</p></header>",
        f"<details class='diff diff-golden' data-diff='0' open><summary>{escape(summary)}</summary>"
        "<div class=lazy></div></details>",
        payload_script(texts, diffs),
        f"<script>{PAGE_JS}</script></body></html>",
    ])


def payload_script(texts: TextStore, diffs: list[dict]) -> str:
    payload = json.dumps({"texts": texts.items, "diffs": diffs}, separators=(",", ":"))
    payload = payload.replace("<", "\\u003c")  # nothing inside can close the script element
    return f"<script type='application/json' id=ap-data>{payload}</script>"


PAGE_CSS = """
body{font:14px/1.4 sans-serif;margin:0 24px 48px;color:#222;max-width:1100px}
h1{font-size:22px;margin:16px 0 4px}h2{font-size:18px;margin:0 0 8px}
section.stage{border-top:2px solid #ccc;padding-top:12px;margin-top:24px;
 content-visibility:auto;contain-intrinsic-size:auto 1400px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:2px 8px;border-radius:10px;margin-right:8px;font-size:13px}
.badge.ok{background:#dff3e4;color:#1d6b35}.badge.bad{background:#fbe0dc;color:#a12b1b}
.badge.none{background:#eee;color:#555}
figure{margin:12px 0}figcaption{font-weight:bold;color:#444;margin-bottom:4px}
p.note{color:#555;font-size:12px;margin:4px 0}
td.members{font:11px monospace;word-break:break-all}
details{margin:6px 0}summary{cursor:pointer;color:#1d4f91}
pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:600px;font-size:12px}
table.diff{font:12px monospace;width:100%;table-layout:fixed}
table.diff td{border:none;padding:0 4px;white-space:pre;overflow:hidden;text-overflow:ellipsis}
table.diff td.ln{width:48px;color:#999;text-align:right}
table.diff tr.r td.a,table.diff tr.d td.a{background:#fde8e6}
table.diff tr.r td.b,table.diff tr.i td.b{background:#e4f6e8}
table.diff tr.fold td{background:#eef2f8;color:#555;text-align:center}
"""

PAGE_JS = r"""
(function(){
  var data=null;
  function D(){if(!data){data=JSON.parse(document.getElementById('ap-data').textContent);}return data;}
  function esc(s){return s.replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;');}
  var CONTEXT=3, LIMIT=4000;
  function row(cls,i,a,j,b){
    return '<tr class="'+cls+'"><td class=ln>'+(i===null?'':i+1)+'</td><td class=a>'+esc(a)+
      '</td><td class=ln>'+(j===null?'':j+1)+'</td><td class=b>'+esc(b)+'</td></tr>';}
  function renderDiff(box,d,all){
    var A=D().texts[d.a].split('\n'),B=D().texts[d.b].split('\n'),out=[],n=0,cut=false;
    out.push('<tr><th></th><th>'+esc(d.a_name)+'</th><th></th><th>'+esc(d.b_name)+'</th></tr>');
    for(var k=0;k<d.ops.length&&!cut;k++){
      var o=d.ops[k],t=o[0],i1=o[1],i2=o[2],j1=o[3],j2=o[4];
      if(t==='e'){
        var len=i2-i1,head=k>0?CONTEXT:0,tail=k<d.ops.length-1?CONTEXT:0;
        if(len<=head+tail+1){for(var x=0;x<len;x++){out.push(row('e',i1+x,A[i1+x],j1+x,B[j1+x]));n++;}}
        else{
          for(var x=0;x<head;x++){out.push(row('e',i1+x,A[i1+x],j1+x,B[j1+x]));n++;}
          out.push('<tr class=fold><td colspan=4>\u22ef '+(len-head-tail)+' unchanged lines \u22ef</td></tr>');
          for(var x=len-tail;x<len;x++){out.push(row('e',i1+x,A[i1+x],j1+x,B[j1+x]));n++;}
        }
      }else{
        var m=Math.max(i2-i1,j2-j1);
        for(var x=0;x<m;x++){
          var ia=i1+x<i2?i1+x:null,jb=j1+x<j2?j1+x:null;
          out.push(row(t,ia,ia===null?'':A[ia],jb,jb===null?'':B[jb]));n++;
          if(!all&&n>=LIMIT){cut=true;break;}
        }
      }
      if(!all&&n>=LIMIT){cut=true;}
    }
    var html='<table class=diff><colgroup><col style="width:48px"><col><col style="width:48px"><col></colgroup>'+out.join('')+'</table>';
    if(cut){html+='<button type=button class=show-all>diff cut at '+LIMIT+' rows: show all</button>';}
    box.innerHTML=html;
    var btn=box.querySelector('button.show-all');
    if(btn){btn.addEventListener('click',function(){renderDiff(box,d,true);});}
  }
  function fill(el){
    if(!el.open||el.dataset.filled){return;}
    var box=el.querySelector('div.lazy');
    if(el.dataset.text!==undefined){
      var pre=document.createElement('pre');pre.textContent=D().texts[+el.dataset.text];box.appendChild(pre);
    }else if(el.dataset.diff!==undefined){renderDiff(box,D().diffs[+el.dataset.diff],false);}
    el.dataset.filled='1';
  }
  document.addEventListener('toggle',function(ev){fill(ev.target);},true);
  document.querySelectorAll('details[open]').forEach(fill);
})();
"""


(function(){
  var q=document.getElementById('filter'),dv=document.getElementById('diverged-only'),
      dp=document.getElementById('differing-only');
  if(!q){return;}
  function readHash(){
    var h=new URLSearchParams(location.hash.slice(1));
    if(h.has('q')){q.value=h.get('q');}
    if(h.has('diverged')){dv.checked=h.get('diverged')!=='0';}
    if(h.has('differing')){dp.checked=h.get('differing')!=='0';}
  }
  function writeHash(){
    var h=new URLSearchParams();
    if(q.value){h.set('q',q.value);}
    h.set('diverged',dv.checked?'1':'0');
    if(dp.checked){h.set('differing','1');}
    history.replaceState(null,'','#'+h.toString());
  }
  function show(el,on){el.hidden=!on;el.classList.toggle('filtered-out',!on);}
  function apply(){
    var text=q.value.trim().toLowerCase(),shown=0,total=0;
    document.querySelectorAll('tr.region-row').forEach(function(tr){
      var on=(!dv.checked||tr.dataset.status==='diverged')&&(!text||tr.dataset.search.indexOf(text)>=0);
      show(tr,on);total++;if(on){shown++;}
    });
    document.querySelectorAll('details.region').forEach(function(d){
      show(d,(!dv.checked||d.dataset.status==='diverged')&&(!text||d.dataset.search.indexOf(text)>=0));
    });
    // a position row matches on its own op/module/source, or when the filter names its region's module
    document.querySelectorAll('tr.pos').forEach(function(tr){
      var region=tr.closest('details.region'),module=region?region.dataset.module:'';
      show(tr,(!dp.checked||tr.dataset.differing==='1')&&
        (!text||module.indexOf(text)>=0||tr.dataset.search.indexOf(text)>=0));
    });
    var c=document.getElementById('shown-count');
    if(c){c.textContent=shown+' of '+total+' region(s) shown';}
    var none=document.getElementById('none-shown');
    if(none){none.hidden=shown>0;}
    document.body.dataset.filtered=(dv.checked||text||dp.checked)?'1':'0';
  }
  readHash();apply();
  [q,dv,dp].forEach(function(el){el.addEventListener('input',function(){apply();writeHash();});});
  window.addEventListener('hashchange',function(){readHash();apply();});
  document.getElementById('expand-all').addEventListener('click',function(){
    document.querySelectorAll('details').forEach(function(d){d.open=true;});});
  document.getElementById('collapse-all').addEventListener('click',function(){
    document.querySelectorAll('details').forEach(function(d){d.open=false;});});
  document.querySelectorAll('button.copy').forEach(function(b){
    b.addEventListener('click',function(){
      var code=b.parentNode.querySelector('code').textContent;
      if(navigator.clipboard){navigator.clipboard.writeText(code).then(function(){b.textContent='copied';});}
    });
  });
})();

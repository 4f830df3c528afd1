import torch, sys
torch.set_num_threads(1)
from gemma4lib.port import *
v = sys.argv[1]; need = float(sys.argv[2])
best = None
for seed in range(0, 60):
    s = PortSettings(variant=v, model="random", backend="eager", seed=seed)
    m = load_model(s); ids = prompt_ids(m, s)
    ref = reference_greedy(m.lm, ids, 32)
    with torch.no_grad():
        full = m.lm(torch.tensor([ids + ref])).logits[0]
    srt = torch.sort(full[len(ids)-1:len(ids)+31], dim=-1, descending=True).values
    margin = (srt[:,0]-srt[:,1]).min().item(); distinct = len(set(ref))
    if distinct >= 10 and (best is None or margin > best[1]): best = (seed, margin, distinct)
    if best and best[1] > need: break
print(v, best)

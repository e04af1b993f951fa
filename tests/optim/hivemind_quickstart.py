"""hivemind's quickstart training script (docs/user/quickstart.md), ported by changing ONE import.

The only other change: hivemind's example trains on CIFAR-10 from torchvision, which would be a
download; this copy feeds random images of the same shape, so the test stays offline.
Run: ``python -m tests.optim.hivemind_quickstart [INITIAL_PEER] --steps N``.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import kit as hivemind  # was: import hivemind

# Create dataset and model, same as in the basic tutorial
# For this basic tutorial, we download only the training set
images = torch.randn(256, 3, 32, 32)
labels = torch.randint(0, 10, (256,))
trainset = list(zip(images, labels, strict=True))

model = nn.Sequential(
    nn.Conv2d(3, 16, (5, 5)),
    nn.MaxPool2d(2, 2),
    nn.ReLU(),
    nn.Conv2d(16, 32, (5, 5)),
    nn.MaxPool2d(2, 2),
    nn.ReLU(),
    nn.Flatten(),
    nn.Linear(32 * 5 * 5, 10),
)
opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)

# Create DHT: a decentralized key-value storage shared between peers
initial_peers = [arg for arg in sys.argv[1:] if arg.startswith("/")]
dht = hivemind.DHT(initial_peers=initial_peers, start=True)
print("\n".join(str(addr) for addr in dht.get_visible_maddrs()), flush=True)

# Set up a decentralized optimizer that will average with peers in background
opt = hivemind.Optimizer(
    dht=dht,  # use a DHT that is connected with other peers
    run_id="my_cifar_run",  # unique identifier of this collaborative run
    batch_size_per_step=32,  # each call to opt.step adds this many samples towards the next epoch
    target_batch_size=128,  # after peers collectively process this many samples, average weights and begin the next epoch
    optimizer=opt,  # wrap the SGD optimizer defined above
    use_local_updates=True,  # perform optimizer steps with local gradients, average parameters in background
    matchmaking_time=2.0,  # when averaging parameters, gather peers in background for up to this many seconds
    averaging_timeout=10.0,  # give up on averaging if not successful in this many seconds
    verbose=True,  # print logs incessently
)

steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
# Note: if you intend to use GPU, switch to it only after the decentralized optimizer is created
losses = []
for _ in range(steps):
    for x_batch, y_batch in torch.utils.data.DataLoader(trainset, shuffle=True, batch_size=32):
        opt.zero_grad()
        loss = F.cross_entropy(model(x_batch), y_batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        break
print(
    f"epoch {opt.local_epoch} first_loss {losses[0]:.4f} last_loss {sum(losses[-5:]) / 5:.4f}",
    flush=True,
)
opt.shutdown()
dht.shutdown()

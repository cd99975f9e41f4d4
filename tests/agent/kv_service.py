"""A user's service that gpumigrate has never seen (not the reference server): a small torch model
behind Starlette with a per-process cache, made migratable with the public SDK only.

POST /v1/predict {"x": [16 floats]} -> {"y": [8 floats]} (a function of the weights alone);
GET /v1/state -> {"served": n, "cache": [8 floats]} (the cache: the running sum of every answer,
a KV-cache stand-in that must travel with the weights).
"""

import os
import threading

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gpumigrate.agent as gm

torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).eval()
if not gm.awaiting_restore():  # stands for loading a checkpoint: a target skips it, the restore fills the weights
    torch.manual_seed(int(os.environ.get("SEED", "0")))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
state = {"cache": torch.zeros(8), "served": 0}
lock = threading.Lock()
handle = gm.attach(model, state=state)


def predict(x: list[float]) -> list[float]:
    with handle.safe_point(), torch.no_grad():
        y = model(torch.tensor(x, dtype=torch.float32))
        with lock:
            state["cache"] += y
            state["served"] += 1
        return y.tolist()


async def predict_route(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"y": await run_in_threadpool(predict, body["x"])})


async def state_route(request: Request) -> JSONResponse:
    with lock:
        return JSONResponse({"served": state["served"], "cache": state["cache"].tolist()})


app = Starlette(routes=[Route("/v1/predict", predict_route, methods=["POST"]), Route("/v1/state", state_route)])
app.add_middleware(gm.ReadinessMiddleware)
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning")

"""RouterCore: the pieces one router process shares between its gRPC and HTTP front ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import make_decode_policy, make_prefill_policy
from pdserve.router.prepare import Preparer, load_tokenizer
from pdserve.router.registry import Registry
from pdserve.router.request_flow import RequestFlow


@dataclass
class RouterCore:
    config: RouterConfig
    tokenizer: Any
    registry: Registry
    preparer: Preparer
    flow: RequestFlow
    metrics: RouterMetrics

    @classmethod
    def build(cls, config: RouterConfig, tokenizer: Any = None) -> RouterCore:
        """Wire everything up; `tokenizer` overrides loading one from `config.model_path`."""
        if tokenizer is None:
            path = config.model_path
            if path is None:
                from pdserve.engine.default_model import default_model_path

                path = default_model_path()
            tokenizer = load_tokenizer(path)
        registry = Registry(config)
        metrics = RouterMetrics(registry)
        flow = RequestFlow(config, registry, make_prefill_policy(config),
                           make_decode_policy(config), tokenizer, metrics)
        preparer = Preparer(tokenizer, registry)
        preparer.warm_up()
        return cls(config=config, tokenizer=tokenizer, registry=registry, preparer=preparer,
                   flow=flow, metrics=metrics)

    async def start(self) -> None:
        await self.registry.start()
        if self.config.k8s_discovery is not None:
            from pdserve.router.k8s_discovery import K8sDiscovery

            self.discovery = K8sDiscovery(self.registry, self.config.k8s_discovery)
            await self.discovery.start()

    async def stop(self) -> None:
        if getattr(self, "discovery", None) is not None:
            await self.discovery.stop()
        await self.flow.drain_background()
        await self.registry.stop()

"""The building blocks of the node dashboard's panels (grafana-foundation-sdk's typed builders): the
datasource every query uses, threshold steps, value mappings, and ``PanelKit``, which writes a selector's
PromQL and builds time series and stat panels the same way for every row (``infra.node.dashboard_*``)."""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.cog import variants as cog_variants
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as dashboard_models

__all__ = [
    "BYTES_PER_MIB",
    "DATASOURCE_TYPE",
    "DATASOURCE_UID",
    "PanelBuilder",
    "PanelKit",
    "datasource_ref",
    "steps",
    "value_text",
]

DATASOURCE_UID = "duplex-prometheus"
DATASOURCE_TYPE = "prometheus"
"""The provisioned datasource; every panel, query and variable of the dashboard refers to it by this uid."""

PanelBuilder = timeseries_builders.Panel | stat_builders.Panel
"""What a row function returns a list of."""

BYTES_PER_MIB = 1024 * 1024  # Redis's "mb" in maxmemory, dcgm-exporter's framebuffer unit


def datasource_ref() -> dashboard_models.DataSourceRef:
    """The provisioned Prometheus datasource (``DATASOURCE_UID``)."""
    return dashboard_models.DataSourceRef(type_val=DATASOURCE_TYPE, uid=DATASOURCE_UID)


def steps(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    """Absolute thresholds from (value, colour) steps; the first value is None (the base)."""
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=value, color=color) for value, color in steps])
    )


def value_text(mapping: dict[str, tuple[str, str]]) -> list[dashboard_models.ValueMapping]:
    """A value mapping: ``{value: (text, colour)}``."""
    return [
        dashboard_models.ValueMap(
            options={
                value: dashboard_models.ValueMappingResult(text=text, color=color, index=index)
                for index, (value, (text, color)) in enumerate(sorted(mapping.items()))
            }
        )
    ]


class PanelKit:
    """Panel builders for one selector (PromQL label matchers without braces). Each row's panels are 24
    columns wide in all (the SDK's layout wraps to a new line once a line is full)."""

    def __init__(self, selector: str) -> None:
        self.selector = selector

    def m(self, metric: str) -> str:
        """``metric{selector}``."""
        return f"{metric}{{{self.selector}}}"

    def rate(self, counter: str, window: str = "$__rate_interval") -> str:
        """``rate(counter{selector}[window])``."""
        return f"rate({self.m(counter)}[{window}])"

    def quantile(self, q: float, histogram: str, window: str = "$__rate_interval") -> str:
        """The ``q`` quantile (0..1) of ``histogram`` (without ``_bucket``) over every selected series."""
        return f"histogram_quantile({q}, sum by (le) ({self.rate(histogram + '_bucket', window)}))"

    @staticmethod
    def targets(queries: Sequence[tuple[str, str]]) -> list[cog_builder.Builder[cog_variants.Dataquery]]:
        """One range query per (PromQL, legend), ref ids A, B, ..."""
        return [
            prometheus_builders.Dataquery()
            .datasource(datasource_ref())
            .expr(expr)
            .legend_format(legend)
            .range()
            .ref_id(chr(ord("A") + index))
            for index, (expr, legend) in enumerate(queries)
        ]

    def timeseries(
        self,
        title: str,
        description: str,
        unit: str,
        queries: Sequence[tuple[str, str]],
        *,
        width: int,
        height: int = 8,
        min_value: float | None = 0,
        max_value: float | None = None,
        threshold: tuple[float, str] | None = None,
        bars: bool = False,
        stacked: bool = False,
        decimals: float | None = None,
    ) -> timeseries_builders.Panel:
        """A time series panel of ``queries`` (PromQL, legend) in ``unit`` (a Grafana unit id), ``width`` of
        24 columns; ``threshold`` (value, what it is) draws a dashed red line and names it in the
        description; ``bars`` and ``stacked`` stack the series."""
        panel = (
            timeseries_builders.Panel()
            .title(title)
            .description(description)
            .datasource(datasource_ref())
            .targets(self.targets(queries))
            .unit(unit)
            .span(width)
            .height(height)
            .line_width(1)
            .fill_opacity(10)
            .legend(
                common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(
                common_builders.VizTooltipOptions()
                .mode(common.TooltipDisplayMode.MULTI)
                .sort(common.SortOrder.DESCENDING)
            )
        )
        if min_value is not None:
            panel.min(min_value)
        if max_value is not None:
            panel.max(max_value)
        if decimals is not None:
            panel.decimals(decimals)
        if bars:
            panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80).stacking(
                common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
            )
        if stacked:
            panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
        if threshold is None:
            panel.thresholds(steps((None, "green")))
        else:
            value, label = threshold
            panel.thresholds(steps((None, "green"), (value, "red"))).thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
            )
            panel.description(f"{description} Dashed red line: {label}.")
        return panel

    def stat(
        self,
        title: str,
        description: str,
        queries: Sequence[tuple[str, str]],
        mapping: dict[str, tuple[str, str]],
        *,
        width: int,
        height: int = 8,
    ) -> stat_builders.Panel:
        """A stat panel of ``queries``' last values, shown as ``mapping``'s texts and colours."""
        return (
            stat_builders.Panel()
            .title(title)
            .description(description)
            .datasource(datasource_ref())
            .targets(self.targets(queries))
            .unit(units.NoUnit)
            .span(width)
            .height(height)
            .mappings(value_text(mapping))
            .thresholds(steps((None, "text")))
            .color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.NONE)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )

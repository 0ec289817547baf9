// Rebuilds us-counties.geojsonl the way /work/shared/data/README.md describes, for machines
// without the shared copy (scripts/county_data.sh runs it, for the tests, the demo and the
// benchmarks): the `counties` object of counties-10m.json from the npm package us-atlas 3.0.1,
// converted to GeoJSON with topojson-client's feature(), null geometries dropped.
// One line per county: {"id": "<5-digit FIPS>", "name": "<county>", "geometry": <GeoJSON>}.
//   usage: node build_counties.js <node_modules directory> > us-counties.geojsonl
"use strict";
const path = require("path");
const modules = process.argv[2];
if (!modules) {
  console.error("usage: node build_counties.js <node_modules directory>");
  process.exit(2);
}
const topojson = require(path.join(modules, "topojson-client"));
const us = require(path.join(modules, "us-atlas", "counties-10m.json"));

let written = 0;
for (const f of topojson.feature(us, us.objects.counties).features) {
  if (f.geometry === null) continue;
  process.stdout.write(JSON.stringify({ id: f.id, name: f.properties.name, geometry: f.geometry }) + "\n");
  written += 1;
}
console.error(`build_counties: ${written} counties`);

// The search app's page script. Result tiles are marked hit or miss, and named on hover, from the data the server
// sends beside the results (#result-data, one entry per tile in gallery order), never from their captions; the
// other galleries' tiles show their whole caption on hover; the embedding map names the point under the pointer
// from its points' pixels (#map-points).
(() => {
  const markResults = () => {
    const data = document.getElementById("result-data");
    const tiles = data ? JSON.parse(data.dataset.tiles || "[]") : [];
    document.querySelectorAll("#results .thumbnail-item").forEach((item, position) => {
      const tile = tiles[position] || {};
      item.classList.toggle("result-hit", tile.mark === "hit");
      item.classList.toggle("result-miss", tile.mark === "miss");
      item.title = tile.title || "";
    });
    document.querySelectorAll("#picker .thumbnail-item, #browsed .thumbnail-item").forEach((item) => {
      const caption = item.querySelector(".caption-label");
      item.title = caption ? caption.textContent : "";
    });
  };
  new MutationObserver(markResults).observe(document.documentElement, {subtree: true, childList: true, characterData: true});
  document.addEventListener("mousemove", (event) => {
    let tip = document.getElementById("map-tooltip");
    if (!tip) { tip = document.createElement("div"); tip.id = "map-tooltip"; document.body.appendChild(tip); }
    const image = event.target.closest ? event.target.closest("#map img") : null;
    const data = document.getElementById("map-points");
    if (!image || !data || !image.naturalWidth) { tip.style.display = "none"; return; }
    const box = image.getBoundingClientRect();
    const x = (event.clientX - box.left) * image.naturalWidth / box.width;
    const y = (event.clientY - box.top) * image.naturalHeight / box.height;
    let best = null, distance = 144;
    for (const [px, py, text] of JSON.parse(data.dataset.points)) {
      const gap = (px - x) ** 2 + (py - y) ** 2;
      if (gap < distance) { distance = gap; best = text; }
    }
    tip.textContent = best || "";
    tip.style.display = best ? "block" : "none";
    tip.style.left = `${event.clientX + 12}px`;
    tip.style.top = `${event.clientY + 12}px`;
    image.title = best || "";
  });
})();

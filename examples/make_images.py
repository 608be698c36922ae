"""Render the sample images in ``examples/images`` (our own content, so they can ship).

    python examples/make_images.py [--out examples/images] [--cjk-font PATH] [--latin-font PATH]

Rendering needs a CJK-capable font (Debian: ``apt-get install fonts-wqy-microhei`` or
``fonts-noto-cjk``); the committed images do not. Output is deterministic for a given font and
Pillow build. ``expected.json`` (beside the folder, so the folder holds only images: `ocrq submit`
submits every file) maps each file to words the OCR must find in it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

CJK_FONTS = (
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
    "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/noto-cjk/NotoSansCJK-Regular.ttc",
)
LATIN_FONTS = ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",)
LATIN_BOLD = ("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",)
MONO_FONTS = ("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",)

#: EXIF tag 0x0112; 6 = "rotate 90° clockwise to display"
ORIENTATION = 0x0112


class Fonts:
    def __init__(self, cjk: str, latin: str, bold: str, mono: str) -> None:
        self.paths = {"cjk": cjk, "latin": latin, "bold": bold, "mono": mono}

    def get(self, kind: str, size: int) -> ImageFont.FreeTypeFont:
        return ImageFont.truetype(self.paths[kind], size)


def _first(paths: Sequence[str], fallback: str | None = None) -> str:
    for p in paths:
        if Path(p).is_file():
            return p
    if fallback:
        return fallback
    raise SystemExit(f"no font found among {list(paths)}; pass it explicitly")


def _sheet(
    fonts: Fonts, size: tuple[int, int], lines: Sequence[tuple[str, str, int, str]],
    bg: str = "white", fg: str = "black", margin: int = 40, spacing: float = 1.5,
) -> Image.Image:
    """Lines of (text, font kind, size, align) top-down; align: "l", "c", "r" or "lr" where the
    text is "left|right" (receipt item and price)."""
    img = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(img)
    y = margin
    for text, kind, px, align in lines:
        font = fonts.get(kind, px)
        if align == "lr":
            left, right = text.split("|")
            draw.text((margin, y), left, font=font, fill=fg)
            draw.text((size[0] - margin, y), right, font=font, fill=fg, anchor="ra")
        elif align == "c":
            draw.text((size[0] // 2, y), text, font=font, fill=fg, anchor="ma")
        elif align == "r":
            draw.text((size[0] - margin, y), text, font=font, fill=fg, anchor="ra")
        elif text:
            draw.text((margin, y), text, font=font, fill=fg)
        y += int(px * spacing)
    return img


def receipt_en(f: Fonts) -> Image.Image:
    m = "mono"
    return _sheet(f, (520, 620), [
        ("GREENLEAF MARKET", "bold", 34, "c"),
        ("12 Harbor Road, Springfield", "latin", 20, "c"),
        ("Tel 555-0142", "latin", 20, "c"),
        ("", m, 14, "l"),
        ("Apples 1kg|3.49", m, 24, "lr"),
        ("Whole Milk|1.99", m, 24, "lr"),
        ("Sourdough Bread|4.25", m, 24, "lr"),
        ("Free Range Eggs|5.10", m, 24, "lr"),
        ("Coffee Beans|11.80", m, 24, "lr"),
        ("", m, 14, "l"),
        ("Subtotal|26.63", m, 24, "lr"),
        ("Tax 8%|2.13", m, 24, "lr"),
        ("TOTAL|28.76", "bold", 28, "lr"),
        ("Card|28.76", m, 24, "lr"),
        ("", m, 14, "l"),
        ("Thank you for shopping!", "latin", 22, "c"),
    ])


def invoice_en(f: Fonts) -> Image.Image:
    return _sheet(f, (900, 420), [
        ("INVOICE", "bold", 48, "l"),
        ("Invoice No: INV-2024-0117", "latin", 26, "l"),
        ("Date: 2024-03-05", "latin", 26, "l"),
        ("Bill To: Northwind Traders Ltd", "latin", 26, "l"),
        ("Due Date: 2024-04-04", "latin", 26, "l"),
        ("Amount Due: USD 1,250.00", "bold", 28, "l"),
    ], margin=50)


def shop_sign_en(f: Fonts) -> Image.Image:
    img = Image.new("RGB", (800, 300), "#7a2e1d")
    draw = ImageDraw.Draw(img)
    draw.rectangle((16, 16, 784, 284), outline="#f3d9a4", width=6)
    draw.text((400, 70), "CORNER BAKERY", font=f.get("bold", 72), fill="#f3d9a4", anchor="ma")
    draw.text((400, 180), "Fresh Bread Daily", font=f.get("latin", 40), fill="white", anchor="ma")
    return img


def street_sign_en(f: Fonts) -> Image.Image:
    img = Image.new("RGB", (900, 360), "#8fb8de")  # sky
    sign = Image.new("RGB", (720, 220), "#0b6b3a")
    draw = ImageDraw.Draw(sign)
    draw.rounded_rectangle((6, 6, 714, 214), radius=18, outline="white", width=5)
    draw.text((360, 30), "Maple Avenue", font=f.get("bold", 64), fill="white", anchor="ma")
    draw.text((360, 125), "EXIT 12  Airport", font=f.get("latin", 48), fill="white", anchor="ma")
    # a slight tilt, as photographed
    sign = sign.rotate(2.5, resample=Image.Resampling.BICUBIC, expand=True, fillcolor="#8fb8de")
    img.paste(sign, ((900 - sign.width) // 2, (360 - sign.height) // 2))
    return img


def notice_zh(f: Fonts) -> Image.Image:
    return _sheet(f, (640, 480), [
        ("营业时间", "cjk", 56, "c"),
        ("周一至周五 09:00-21:00", "cjk", 32, "c"),
        ("周六 10:00-18:00", "cjk", 32, "c"),
        ("周日休息", "cjk", 32, "c"),
        ("欢迎光临", "cjk", 40, "c"),
    ], bg="#fff8e7", fg="#202020", margin=40, spacing=1.7)


def receipt_zh(f: Fonts) -> Image.Image:
    return _sheet(f, (520, 620), [
        ("便利店收银小票", "cjk", 34, "c"),
        ("单号：20240305001", "cjk", 22, "l"),
        ("", "cjk", 12, "l"),
        ("牛奶|12.50", "cjk", 26, "lr"),
        ("面包|8.00", "cjk", 26, "lr"),
        ("苹果|15.60", "cjk", 26, "lr"),
        ("矿泉水|3.00", "cjk", 26, "lr"),
        ("", "cjk", 12, "l"),
        ("合计|39.10", "cjk", 30, "lr"),
        ("现金|50.00", "cjk", 26, "lr"),
        ("找零|10.90", "cjk", 26, "lr"),
        ("谢谢惠顾", "cjk", 28, "c"),
    ])


def invoice_zh(f: Fonts) -> Image.Image:
    return _sheet(f, (820, 380), [
        ("销售发票", "cjk", 52, "c"),
        ("发票号码：No.88012345", "cjk", 28, "l"),
        ("开票日期：2024年3月5日", "cjk", 28, "l"),
        ("购买方：上海星河贸易有限公司", "cjk", 28, "l"),
        ("金额合计：人民币1250.00元", "cjk", 28, "l"),
    ], margin=48)


def shop_sign_zh(f: Fonts) -> Image.Image:
    img = Image.new("RGB", (760, 260), "#b3121b")
    draw = ImageDraw.Draw(img)
    draw.text((380, 40), "老王面馆", font=f.get("cjk", 110), fill="#ffd54a", anchor="ma")
    draw.text((380, 185), "手工拉面 · 牛肉面", font=f.get("cjk", 40), fill="white", anchor="ma")
    return img


def exit_sign(f: Fonts) -> Image.Image:
    img = Image.new("RGB", (560, 220), "#0a7d3b")
    draw = ImageDraw.Draw(img)
    draw.text((280, 30), "安全出口", font=f.get("cjk", 72), fill="white", anchor="ma")
    draw.text((280, 130), "EXIT", font=f.get("bold", 56), fill="white", anchor="ma")
    return img


def rotated_photo(f: Fonts) -> Image.Image:
    """Upright content; ``main`` stores it rotated with an EXIF orientation tag."""
    return _sheet(f, (760, 300), [
        ("PLATFORM 3", "bold", 56, "c"),
        ("Next train: Riverside 08:45", "latin", 32, "c"),
        ("Mind the gap", "latin", 32, "c"),
    ], bg="#f2f2f2", margin=50)


def gray_memo(f: Fonts) -> Image.Image:
    img = _sheet(f, (760, 360), [
        ("MEMO", "bold", 44, "l"),
        ("To: Warehouse Team", "latin", 28, "l"),
        ("Inventory count starts Monday at 7am.", "latin", 28, "l"),
        ("Please bring your badge.", "latin", 28, "l"),
    ], bg="#e8e8e8", fg="#303030", margin=44)
    return img.convert("L")


def single_line(f: Fonts) -> Image.Image:
    img = Image.new("RGB", (520, 64), "white")
    ImageDraw.Draw(img).text((16, 12), "Hello from ocrq 2024", font=f.get("latin", 34), fill="black")
    return img


EXPECTED: dict[str, list[str]] = {
    "receipt_en.png": ["GREENLEAF", "MARKET", "Apples", "Sourdough", "Subtotal", "26.63", "TOTAL",
                       "28.76", "Thank"],
    "invoice_en.png": ["INVOICE", "INV-2024-0117", "2024-03-05", "Northwind", "1,250.00"],
    "shop_sign_en.jpg": ["CORNER", "BAKERY", "Fresh", "Bread", "Daily"],
    "street_sign_en.jpg": ["Maple", "Avenue", "EXIT", "Airport"],
    "notice_zh.png": ["营业时间", "周一至周五", "09:00-21:00", "周六", "周日休息", "欢迎光临"],
    "receipt_zh.png": ["便利店收银小票", "牛奶", "12.50", "合计", "39.10", "找零", "谢谢惠顾"],
    "invoice_zh.png": ["销售发票", "88012345", "上海星河贸易有限公司", "1250.00"],
    "shop_sign_zh.jpg": ["老王面馆", "牛肉面"],
    "exit_sign.png": ["安全出口", "EXIT"],
    "rotated_exif.jpg": ["PLATFORM", "Riverside", "08:45", "Mind", "gap"],
    "memo_gray.png": ["MEMO", "Warehouse", "Inventory", "Monday", "badge"],
    "single_line.png": ["Hello", "from", "ocrq", "2024"],
    "receipt_en_copy.png": ["GREENLEAF", "TOTAL", "28.76"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "images")
    ap.add_argument("--cjk-font", default=None)
    ap.add_argument("--latin-font", default=None)
    args = ap.parse_args()
    cjk = args.cjk_font or _first(CJK_FONTS)
    fonts = Fonts(
        cjk=cjk,
        latin=args.latin_font or _first(LATIN_FONTS, cjk),
        bold=_first(LATIN_BOLD, args.latin_font or cjk),
        mono=_first(MONO_FONTS, args.latin_font or cjk),
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def png(name: str, img: Image.Image) -> None:
        img.save(out / name, optimize=True)

    def jpg(name: str, img: Image.Image, exif: bytes = b"") -> None:
        img.save(out / name, quality=88, optimize=True, exif=exif)

    png("receipt_en.png", receipt_en(fonts))
    png("invoice_en.png", invoice_en(fonts))
    jpg("shop_sign_en.jpg", shop_sign_en(fonts))
    jpg("street_sign_en.jpg", street_sign_en(fonts))
    png("notice_zh.png", notice_zh(fonts))
    png("receipt_zh.png", receipt_zh(fonts))
    png("invoice_zh.png", invoice_zh(fonts))
    jpg("shop_sign_zh.jpg", shop_sign_zh(fonts))
    png("exit_sign.png", exit_sign(fonts))
    png("memo_gray.png", gray_memo(fonts))
    png("single_line.png", single_line(fonts))
    # stored pixels are the upright page turned 90° counter-clockwise; Orientation=6 tells a
    # viewer (and ImageOps.exif_transpose) to turn it back clockwise
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    jpg("rotated_exif.jpg", rotated_photo(fonts).transpose(Image.Transpose.ROTATE_90),
        exif=exif.tobytes())
    # same bytes under another name: the content cache must answer it without OCR
    shutil.copyfile(out / "receipt_en.png", out / "receipt_en_copy.png")
    (out.parent / "expected.json").write_text(
        json.dumps(EXPECTED, ensure_ascii=False, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {len(EXPECTED)} images + expected.json to {out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
